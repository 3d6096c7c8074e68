"""The grant Pod's scope: what the home asserts about where it runs, and when that stops being true.

``scope_claims`` turns a Pod reading into the core's scope claims
(namespace, service account, Pod, Pod UID, node, one per DRA claim);
``identity_claims`` gives those the downward API names, before any reading.
``ScopeTracker.observe`` compares each reading of the Pod and its claims
with what fiberd started under and returns the losses found: the Pod is
being deleted (``deletionTimestamp``), is gone, or is another Pod of the
same name (UID changed), or the API server refuses its bound token
(``token_refused``: the home judges the 401s); a claim was deallocated,
is being deleted, is gone or was recreated (UID changed). Each loss carries a stable one-line reason
(the same loss yields the same text on every round, so a ScopeLossQueue
delivers it once) and whether it removes the grants (the Pod is over: stop
its fibers) or bumps the epoch (the devices went away under running
fibers). Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from slurm_fiber.core.trust.grant import ScopeClaim
from slurm_fiber.homes.kubernetes.incluster import PodIdentity
from slurm_fiber.homes.kubernetes.views import ClaimView, PodView

PREFIX = "kubernetes."


class LossKind(enum.StrEnum):
    POD_DELETING = "pod_deleting"
    POD_GONE = "pod_gone"
    POD_REPLACED = "pod_replaced"
    POD_TOKEN_REFUSED = "pod_token_refused"
    CLAIM_DEALLOCATED = "claim_deallocated"
    CLAIM_DELETING = "claim_deleting"
    CLAIM_GONE = "claim_gone"
    CLAIM_REPLACED = "claim_replaced"


POD_LOSSES = frozenset({LossKind.POD_DELETING, LossKind.POD_GONE, LossKind.POD_REPLACED,
                        LossKind.POD_TOKEN_REFUSED})


@dataclass(frozen=True)
class ScopeLoss:
    """One lost piece of scope and the reason to hand a ScopeLossQueue."""

    kind: LossKind
    reason: str

    @property
    def removes_grants(self) -> bool:
        """True when the Pod itself is over (remove grants); False: bump the epoch."""
        return self.kind in POD_LOSSES


def scope_claims(pod: PodView) -> list[ScopeClaim]:
    """The scope claims a Pod reading supports, in a fixed order (absent fields left out)."""
    return _claims(pod.namespace, pod.service_account, pod.name, pod.uid, pod.node, pod.claims)


def identity_claims(identity: PodIdentity) -> list[ScopeClaim]:
    """The scope claims the downward API alone supports, before the Pod was ever read."""
    return _claims(identity.namespace, identity.service_account, identity.name, identity.uid,
                   identity.node, ())


def _claims(namespace: str, service_account: str | None, pod: str, uid: str, node: str | None,
            claims: tuple[str, ...]) -> list[ScopeClaim]:
    pairs = [
        ("namespace", namespace),
        ("service_account", service_account),
        ("pod", pod),
        ("pod_uid", uid),
        ("node", node),
        *(("resource_claim", claim) for claim in claims),
    ]
    return [ScopeClaim(PREFIX + key, value) for key, value in pairs if value]


class ScopeTracker:
    """Remembers the Pod's claims and their UIDs at first sight; finds losses in later readings.

    Not thread-safe; the home calls ``observe`` from its poll round.
    """

    def __init__(self, identity: PodIdentity) -> None:
        self.identity = identity
        self._claim_uids: dict[str, str] = {}
        self._claims: tuple[str, ...] = ()

    def claims_to_read(self, pod: PodView | None) -> tuple[str, ...]:
        """The ResourceClaim names a round reads after reading ``pod``: every claim ever seen.

        Claims of a Pod with another UID are not ours and are left out.
        """
        if pod is None or pod.uid != self.identity.uid:
            return self._claims
        return tuple(dict.fromkeys((*self._claims, *pod.claims)))

    def observe(
        self, pod: PodView | None, claims: Mapping[str, ClaimView | None]
    ) -> list[ScopeLoss]:
        """The losses in one round's reading; ``pod`` or a claim is None when the API said 404.

        ``claims`` maps the names ``claims_to_read(pod)`` gave to their readings;
        names missing from the map are not judged this round.
        """
        losses = self._pod_losses(pod)
        self._claims = self.claims_to_read(pod)
        for name, claim in claims.items():
            losses.extend(self._claim_losses(name, claim))
        return losses

    def _pod_losses(self, pod: PodView | None) -> list[ScopeLoss]:
        me = f"pod {self.identity.namespace}/{self.identity.name}"
        if pod is None:
            return [ScopeLoss(LossKind.POD_GONE, f"{me} no longer exists")]
        if pod.uid != self.identity.uid:
            return [
                ScopeLoss(
                    LossKind.POD_REPLACED,
                    f"{me} is another Pod now (UID {self.identity.uid} became {pod.uid})",
                )
            ]
        if pod.deletion_timestamp is not None:
            return [
                ScopeLoss(
                    LossKind.POD_DELETING,
                    f"{me} is being deleted (deletionTimestamp {pod.deletion_timestamp})",
                )
            ]
        return []

    def token_refused(self) -> ScopeLoss:
        """The loss for an API server that keeps refusing the Pod's token (401): the Pod is over."""
        me = f"pod {self.identity.namespace}/{self.identity.name}"
        return ScopeLoss(
            LossKind.POD_TOKEN_REFUSED,
            f"the API server refuses {me}'s service account token (401): the token's Pod "
            "was deleted or replaced, or the token was revoked",
        )

    def _claim_losses(self, name: str, claim: ClaimView | None) -> list[ScopeLoss]:
        me = f"resourceclaim {self.identity.namespace}/{name}"
        if claim is None:
            return [ScopeLoss(LossKind.CLAIM_GONE, f"{me} no longer exists")]
        first_uid = self._claim_uids.setdefault(name, claim.uid)
        if claim.uid != first_uid:
            return [
                ScopeLoss(
                    LossKind.CLAIM_REPLACED,
                    f"{me} was recreated (UID {first_uid} became {claim.uid})",
                )
            ]
        losses = []
        if claim.deletion_timestamp is not None:
            losses.append(
                ScopeLoss(
                    LossKind.CLAIM_DELETING,
                    f"{me} is being deleted (deletionTimestamp {claim.deletion_timestamp})",
                )
            )
        if not claim.allocated:
            losses.append(ScopeLoss(LossKind.CLAIM_DEALLOCATED, f"{me} was deallocated"))
        return losses
