"""One reading of the grant Pod and its ResourceClaims: the body of the home's health poll round.

``read_scope`` reads the Pod, then every ResourceClaim the Pod has ever
named, and judges them with a ``ScopeTracker``. The ``Reading`` it returns
holds what the home needs after an answered round: the losses to hand a
ScopeLossQueue, the scope claims to stamp on audit records, and the devices
the claims' allocations hold. A round that does not complete raises
``ApiFailure`` and judges nothing, so a failed round never reports a loss
and never moves the tracker.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_fiber.core.devices import DeviceChannel
from slurm_fiber.core.trust.grant import ScopeClaim
from slurm_fiber.homes.kubernetes.api import KubeApi
from slurm_fiber.homes.kubernetes.claimdevices import claim_devices
from slurm_fiber.homes.kubernetes.scope import ScopeLoss, ScopeTracker, scope_claims
from slurm_fiber.homes.kubernetes.views import ClaimView, PodView


@dataclass(frozen=True)
class Reading:
    """What one answered round saw (None: the API said the object does not exist)."""

    pod: PodView | None
    claims: dict[str, ClaimView | None]
    losses: list[ScopeLoss]

    @property
    def scope(self) -> list[ScopeClaim]:
        """The scope claims this reading supports (none once the Pod is gone)."""
        return scope_claims(self.pod) if self.pod is not None else []

    @property
    def devices(self) -> DeviceChannel:
        """The devices the claims still hold allocated."""
        return claim_devices(c for c in self.claims.values() if c is not None)


async def read_scope(api: KubeApi, tracker: ScopeTracker) -> Reading:
    """Read the Pod and its claims and judge them; raises ApiFailure when a read fails."""
    pod = await api.read_pod()
    claims = {name: await api.read_claim(name) for name in tracker.claims_to_read(pod)}
    return Reading(pod, claims, tracker.observe(pod, claims))
