"""The Kubernetes home's calls to its API server, through lightkube, as views the home decides on.

``KubeApi`` makes the three calls the home needs: read its own Pod (the
health round, and the scope reading), read a ResourceClaim
(``resource.k8s.io/v1``), and patch one Pod status condition (the
readiness gate). The condition is sent as a strategic merge patch on the
``status`` subresource, so the server merges it by ``type`` and keeps every
other condition; the patch carries the Pod's UID as a precondition, so it
never lands on another Pod that took the same name (the server answers
``422 Invalid``: ``metadata.uid`` is immutable, and writes nothing).

Authentication: the Pod's projected service account token (``PodToken``),
read from its file again by ``reload_token`` (the home calls it at the start
of every round), so a token the kubelet rotated is used from the next round
and a 401 is always the answer to the token the file holds now; a 401 also
re-reads the file once and retries when the token changed in between.

Errors: a 404 on a read is an answer (None: the object is gone). Every other
failure raises ``ApiFailure``: ``code`` is the HTTP status (None when the
server could not be reached, timed out, or sent something unreadable) and
the message is one stable line, so a poll reports each distinct failure
once. Calls are coroutines on the caller's loop; cancelling one (a poll
round's timeout) abandons its request.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
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


class PodToken(httpx2.Auth):
    """The Pod's bearer token, kept from its last read of ``path``; the auth of every request.

    ``reload`` reads the file (a small tmpfs read, blocking briefly) and
    raises ApiFailure (code None) when it is missing, unreadable or empty.
    The first request reads it when ``reload`` was never called.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._bearer: str | None = None

    def reload(self) -> bool:
        """Read the token file again; returns whether the token changed."""
        try:
            token = self.path.read_text().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ApiFailure(None, f"cannot read the service account token {self.path}: "
                                   f"{getattr(err, 'strerror', None) or err}") from None
        if not token:
            raise ApiFailure(None, f"the service account token {self.path} is empty")
        bearer = f"Bearer {token}"
        changed, self._bearer = bearer != self._bearer, bearer
        return changed

    async def async_auth_flow(
        self, request: httpx2.Request
    ) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        if self._bearer is None:
            self.reload()
        request.headers["Authorization"] = str(self._bearer)
        response = yield request
        if response.status_code == 401 and self.reload():
            request.headers["Authorization"] = str(self._bearer)
            yield request


class KubeApi:
    """The home's API client for one Pod; create once, ``aclose`` when done. Not thread-safe.

    ``timeout`` bounds each request (seconds); ``clock`` stamps the
    condition's ``lastTransitionTime``.
    """

    def __init__(self, config: InClusterConfig, *, clock: Clock, timeout: float = 10.0) -> None:
        self.pod: PodIdentity = config.pod
        self._server = config.server
        self._clock = clock
        self.token = PodToken(config.token_file)
        self._client = AsyncClient(
            config.kubeconfig(), namespace=config.pod.namespace, timeout=httpx2.Timeout(timeout)
        )
        _use_auth(self._client, self.token)

    def reload_token(self) -> None:
        """Read the token file again for the next requests; raises ApiFailure (None) if unusable."""
        self.token.reload()

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

        Raises ApiFailure (422 when the Pod now has another UID, 404 when gone).
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


def _use_auth(client: AsyncClient, auth: httpx2.Auth) -> None:
    """Make ``auth`` the auth of lightkube's underlying httpx client (set at construction).

    lightkube only offers a token file it reads once and again on a 401; the
    home needs to re-read it each round. Raises RuntimeError when lightkube's
    layout changed, so the mismatch shows at start, not as requests without a token.
    """
    http = getattr(getattr(client, "_client", None), "_client", None)
    if not isinstance(http, httpx2.AsyncClient):
        raise RuntimeError("lightkube's AsyncClient no longer wraps an httpx AsyncClient")
    http.auth = auth
