"""The Kubernetes home's calls to its API server, through lightkube, as views the home decides on.

``KubeApi`` makes the three calls the home needs: read its own Pod (the
health round, and the scope reading), read a ResourceClaim
(``resource.k8s.io/v1``), and patch one Pod status condition (the
readiness gate). The condition is sent as a strategic merge patch on the
``status`` subresource, so the server merges it by ``type`` and keeps every
other condition; the patch carries the Pod's UID as a precondition, so it
never lands on another Pod that took the same name (409 instead).

Errors: a 404 on a read is an answer (None: the object is gone). Every other
failure raises ``ApiFailure``: ``code`` is the HTTP status (None when the
server could not be reached, timed out, or sent something unreadable) and
the message is one stable line, so a poll reports each distinct failure
once. Calls are coroutines on the caller's loop; cancelling one (a poll
round's timeout) abandons its request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx2
from lightkube import ApiError, AsyncClient, ConfigError
from lightkube.resources.core_v1 import Pod
from lightkube.resources.resource_v1 import ResourceClaim
from lightkube.types import PatchType

from slurm_fiber.core.clock import Clock
from slurm_fiber.homes.kubernetes.incluster import InClusterConfig, PodIdentity
from slurm_fiber.homes.kubernetes.views import (
    ClaimView,
    PodView,
    ViewError,
    claim_view,
    pod_view,
    rfc3339,
)

T = TypeVar("T")


class ApiFailure(Exception):
    """A call the API server did not answer usefully; ``code`` is its HTTP status if it sent one."""

    def __init__(self, code: int | None, message: str) -> None:
        super().__init__(message)
        self.code = code


class KubeApi:
    """The home's API client for one Pod; create once, ``aclose`` when done. Not thread-safe.

    ``timeout`` bounds each request (seconds); ``clock`` stamps the
    condition's ``lastTransitionTime``.
    """

    def __init__(self, config: InClusterConfig, *, clock: Clock, timeout: float = 10.0) -> None:
        self.pod: PodIdentity = config.pod
        self._server = config.server
        self._clock = clock
        self._client = AsyncClient(
            config.kubeconfig(), namespace=config.pod.namespace, timeout=httpx2.Timeout(timeout)
        )

    async def read_pod(self) -> PodView | None:
        """Read this Pod; None when the server says it does not exist. Raises ApiFailure."""
        return await self._read(
            f"read pod {self.pod.namespace}/{self.pod.name}",
            lambda: self._client.get(Pod, self.pod.name, namespace=self.pod.namespace),
            pod_view,
        )

    async def read_claim(self, name: str) -> ClaimView | None:
        """Read a ResourceClaim in this Pod's namespace; None when it does not exist."""
        return await self._read(
            f"read resourceclaim {self.pod.namespace}/{name}",
            lambda: self._client.get(ResourceClaim, name, namespace=self.pod.namespace),
            claim_view,
        )

    async def set_condition(
        self, condition_type: str, status: bool, *, reason: str, message: str
    ) -> PodView:
        """Set one condition on this Pod's status, keeping the others; returns the Pod written.

        Raises ApiFailure (409 when the Pod now has another UID, 404 when gone).
        """
        patch = {
            "metadata": {"uid": self.pod.uid},
            "status": {
                "conditions": [
                    {
                        "type": condition_type,
                        "status": "True" if status else "False",
                        "reason": reason,
                        "message": message,
                        "lastTransitionTime": rfc3339(self._clock.wall()),
                    }
                ]
            },
        }
        action = f"set condition {condition_type} on pod {self.pod.namespace}/{self.pod.name}"
        written = await self._call(
            action,
            lambda: self._client.patch(
                Pod.Status,
                self.pod.name,
                patch,
                namespace=self.pod.namespace,
                patch_type=PatchType.STRATEGIC,
            ),
        )
        return self._view(action, written, pod_view)

    async def aclose(self) -> None:
        """Close the connections. Idempotent."""
        await self._client.close()

    async def _read(
        self, action: str, call: Callable[[], Awaitable[Any]], parse: Callable[[Any], T]
    ) -> T | None:
        try:
            obj = await self._call(action, call)
        except ApiFailure as failure:
            if failure.code == 404:
                return None
            raise
        return self._view(action, obj, parse)

    async def _call(self, action: str, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await call()
        except ApiError as err:
            status = err.status
            raise ApiFailure(
                status.code, f"{action}: {status.code} {status.reason}: {status.message}"
            ) from None
        except httpx2.HTTPStatusError as err:
            code = err.response.status_code
            raise ApiFailure(code, f"{action}: {code} with an unreadable body") from None
        except (httpx2.HTTPError, ConfigError) as err:
            detail = str(err) or "no detail"
            raise ApiFailure(
                None, f"{action}: cannot reach {self._server}: {type(err).__name__}: {detail}"
            ) from None
        except ValueError as err:
            raise ApiFailure(None, f"{action}: the answer is not an API object: {err}") from None

    @staticmethod
    def _view(action: str, obj: Any, parse: Callable[[Any], T]) -> T:
        try:
            return parse(obj.to_dict())
        except ViewError as err:
            raise ApiFailure(None, f"{action}: {err}") from None
