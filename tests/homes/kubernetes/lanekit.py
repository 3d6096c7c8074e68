"""The API servers the Kubernetes tests can run a scenario on: the fake, or a real kube-apiserver.

A ``Lane`` is what a scenario drives: where the server listens, the CA to
trust, the grant Pod's UID, a token bound to it, and a forced replacement of
the Pod under its name. ``real_lane`` starts a real kube-apiserver on
loopback (``testing.kubernetes.realserver``) with the grant Pod created, or
skips the test with the reason when none was built here (CI builds it
first, and there a skip fails the run).
"""

from __future__ import annotations

from typing import Protocol

import pytest

from slurm_fiber.testing.kubernetes import realserver


class Lane(Protocol):
    name: str
    port: int
    ca_pem: bytes

    def pod_uid(self) -> str: ...

    def bound_token(self) -> str: ...

    def replace_pod(self) -> None: ...

    def close(self) -> None: ...


class RealLane:
    """A real kube-apiserver holding the grant Pod ``pod`` in namespace ``grants``."""

    name = "real"

    def __init__(self, pod: str) -> None:
        self.pod = pod
        self.server = realserver.RealApiServer().start()
        try:
            self.server.create_pod(pod, claims={"gpus": f"{pod}-gpus"})  # v1.20 drops them
        except BaseException:
            self.server.close()
            raise
        self.port = self.server.port
        self.ca_pem = self.server.ca_pem

    def pod_uid(self) -> str:
        current = self.server.pod(self.pod)
        assert current is not None
        return str(current["metadata"]["uid"])

    def bound_token(self) -> str:
        return self.server.bound_token(self.pod)

    def replace_pod(self) -> None:
        self.server.replace_pod(self.pod)

    def close(self) -> None:
        self.server.close()


def real_lane(pod: str) -> RealLane:
    """A started RealLane; skips (with the reason) when this machine has no built apiserver."""
    why = realserver.missing()
    if why is not None:
        pytest.skip(why)
    return RealLane(pod)
