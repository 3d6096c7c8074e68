"""The Kubernetes home's stage: a grant Pod on the fake API server, over real HTTPS.

The stage starts a ``FakeApiServer`` (TLS, its own CA, RBAC from
``deploy/kubernetes/rbac.yaml``) holding one running grant Pod whose DRA
ResourceClaim is allocated two GPUs, lays out the Pod's service account
volume (a token bound to the Pod) and an empty Secret volume, and gives fiberd the
container environment the kubelet and the downward API would. Nothing is
patched: fiberd's real client talks to the fake as to a real API server.

Levers: the Secret volume is written the way the kubelet writes it (every
change is a new payload swapped in through ``..data``), so delivering or
removing one grant rewrites the whole Secret; silence stops the fake (the
API server is unreachable: connection refused) and restore starts it on the
same port; losing scope deletes the Pod (it keeps a ``deletionTimestamp``
and its grants go with it; irreversible). Readiness is the Pod's
readiness-gate condition now, and the history of every status PATCH the
fake answered 200, read from its request log, so every publish counts,
however quick. Devices are the claim's GPUs as the container sees them
(ordinals from 0 in allocation order, with their uuids).

Declared lack: device holds. A DRA claim is allocated to the Pod for its
whole life, not per grant, so fiberd holds nothing per grant and the
home's release is a no-op: there is nothing a grant's removal could free.

``RealKubernetesStage`` (``--home slurm_fiber.conform.kubernetes:RealKubernetesStage``)
is the same Pod on a real kube-apiserver v1.20.2 with etcd on loopback
(``testing.kubernetes.realserver``: RBAC with ``deploy/kubernetes/rbac.yaml``
applied unchanged, a token from TokenRequest bound to the Pod). Silence
SIGSTOPs the apiserver (connections hang; each round times out) and restore
SIGCONTs it; losing scope deletes the Pod through the API (graceful, no
kubelet finishes it); the readiness history is every status PATCH the
apiserver's audit log records as answered 200. It also declares devices
lacking: v1.20 has no DRA (``realserver.NO_DRA``), so ``devices.provisioned``
is a declared skip with that reason. Opening it raises StageCannot when no
apiserver was built here. ``KilledRealKubernetesStage`` silences by SIGKILL
instead (connections refused) and restores by starting the apiserver again
on the same port, with the same etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from pathlib import Path

from slurm_fiber.conform.stage import (
    Capability,
    Issuer,
    Launch,
    OpenedStage,
    Published,
    StageCannot,
    while_open,
)
from slurm_fiber.core.devices import Device
from slurm_fiber.homes.kubernetes.incluster import (
    ENV_NODE_NAME,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    ENV_POD_UID,
    ENV_SERVICE_ACCOUNT,
    ENV_SERVICE_ACCOUNT_DIR,
)
from slurm_fiber.homes.select import load_config
from slurm_fiber.testing.kubernetes import realserver
from slurm_fiber.testing.kubernetes.fake import (
    DEFAULT_GATE,
    PODS,
    RESOURCE_CLAIMS,
    Allocated,
    FakeApiServer,
    grant_pod,
    resource_claim,
    write_secret,
)
from slurm_fiber.testing.kubernetes.fake.store import ApiStatus

NAMESPACE = "grants"  # deploy/kubernetes/rbac.yaml's: the fake applies its Role and binding
POD = "grant-pod"
POD_UID = "c0f0a11e-grant-pod-uid"
NODE = "node-conform"
SERVICE_ACCOUNT = "slurm-fiber"
CLAIM = "grant-pod-gpus-conform"
ALLOCATED = (
    Allocated("gpus", "gpu.nvidia.com", NODE, "gpu-3", uuid="GPU-conform-k8s-3"),
    Allocated("gpus", "gpu.nvidia.com", NODE, "gpu-5", uuid="GPU-conform-k8s-5"),
)
# What the container sees of ALLOCATED: the DRA driver injects exactly those devices,
# numbered from 0 in allocation order.
DEVICES = (Device("gpu", 0, None, "GPU-conform-k8s-3"), Device("gpu", 1, None, "GPU-conform-k8s-5"))
POLL_INTERVAL = 0.05  # seconds between grantdir polls and API rounds; a round gets one
STALE_TTL = 1.0  # seconds of API silence until the source is stale
FENCE_TTL = 2.0
STATUS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods/{POD}/status"


def condition_sent(body: bytes, gate: str = DEFAULT_GATE) -> bool | None:
    """The readiness-gate state a status PATCH body sets, None when it sets none. Pure."""
    try:
        conditions = json.loads(body)["status"]["conditions"]
    except (ValueError, KeyError, TypeError):
        return None
    for condition in conditions if isinstance(conditions, list) else []:
        if isinstance(condition, dict) and condition.get("type") == gate:
            return {"True": True, "False": False}.get(str(condition.get("status")))
    return None


class KubernetesStage(OpenedStage):
    """Drives ``fiberd --home kubernetes`` against a fake API server. Open it once."""

    home = "kubernetes"
    lacks: Mapping[Capability, str] = {
        Capability.DEVICE_HOLDS: "a DRA claim stays allocated to the Pod for its life; fiberd "
                                 "holds nothing per grant, so a removal releases nothing",
    }

    def __init__(self) -> None:
        super().__init__()
        self._fake: FakeApiServer | None = None
        self._payload: dict[str, bytes] = {}

    @property
    def fake(self) -> FakeApiServer:
        return while_open(self._fake)

    @property
    def volume(self) -> Path:
        """The grant Secret's mount: the grantdir fiberd reads."""
        return self.root / "secret"

    async def open(self, workdir: Path, issuer: Issuer) -> None:
        """Start the fake with the Pod and its allocated claim; lay out the volumes."""
        self.opened(workdir, issuer)
        fake = FakeApiServer()
        self._fake = fake.start()
        fake.store.put(PODS, grant_pod(POD, NAMESPACE, uid=POD_UID, node=NODE,
                                       service_account=SERVICE_ACCOUNT,
                                       claims={"gpus": CLAIM}))
        fake.store.put(RESOURCE_CLAIMS, resource_claim(CLAIM, NAMESPACE, ALLOCATED))
        fake.write_service_account(workdir / "serviceaccount", NAMESPACE,
                                   token=fake.bound_token(NAMESPACE, POD))
        self.volume.mkdir(mode=0o755)
        (workdir / "state").mkdir(mode=0o700)

    async def close(self) -> None:
        """Stop the fake and remove its files. Never raises."""
        if self._fake is not None:
            with contextlib.suppress(Exception):
                self._fake.close()
            self._fake = None

    def launch(self) -> Launch:
        """fiberd in the grant Pod: the Secret volume as grantdir, short intervals, uncarved."""
        flags = {
            "home": "kubernetes", "state_dir": str(self.root / "state"),
            "grantdir": str(self.volume), "trust": self.trust,
            "poll_interval": str(POLL_INTERVAL), "stale_ttl": str(STALE_TTL),
            "fence_ttl": str(FENCE_TTL), "grace": "0.5", "cgroup_root": "none",
            "audit_fsync": "never",
        }
        environ = {
            **self._api_env(),
            ENV_POD_NAME: POD, ENV_POD_NAMESPACE: NAMESPACE, ENV_POD_UID: POD_UID,
            ENV_NODE_NAME: NODE, ENV_SERVICE_ACCOUNT: SERVICE_ACCOUNT,
            ENV_SERVICE_ACCOUNT_DIR: str(self.root / "serviceaccount"),
        }
        return Launch(load_config(env={}, flags=flags), environ)

    def _api_env(self) -> dict[str, str]:
        """The kubelet's service variables pointing at the API server."""
        return self.fake.in_cluster_env()

    async def deliver(self, uid: str, token: str) -> None:
        """Update the Secret with ``<uid>.jwt``: the kubelet swaps in the new payload."""
        self._payload[f"{uid}.jwt"] = token.encode()
        write_secret(self.volume, self._payload)

    async def remove(self, uid: str) -> None:
        """Update the Secret without ``<uid>.jwt`` (no write when it holds none)."""
        if self._payload.pop(f"{uid}.jwt", None) is not None:
            write_secret(self.volume, self._payload)

    async def silence(self) -> None:
        """Stop the API server: connections are refused until ``restore``."""
        self.fake.stop()

    async def restore(self) -> None:
        """Start the API server again on the same port."""
        self.fake.start()

    async def lose_scope(self) -> None:
        """Delete the grant Pod (graceful: it keeps a deletionTimestamp). Irreversible."""
        self.fake.store.delete(PODS, NAMESPACE, POD)

    def readiness(self) -> Published:
        """The Pod's readiness-gate condition now; every state a status PATCH set, in order."""
        history = tuple(state for seen in self.fake.seen
                        if seen.method == "PATCH" and seen.path == STATUS_PATH
                        and seen.code == 200
                        for state in [condition_sent(seen.body)] if state is not None)
        return Published(self._condition(), history)

    def devices(self) -> tuple[Device, ...]:
        """The claim's two GPUs as the container numbers them."""
        return DEVICES

    def held_devices(self) -> frozenset[Device]:
        raise NotImplementedError("a DRA claim is the Pod's, not a grant's")

    def _condition(self) -> bool | None:
        try:
            pod = self.fake.store.get(PODS, NAMESPACE, POD)
        except ApiStatus:
            return None
        for condition in pod.get("status", {}).get("conditions", []):
            if condition.get("type") == DEFAULT_GATE:
                return {"True": True, "False": False}.get(condition.get("status"))
        return None


class RealKubernetesStage(KubernetesStage):
    """The grant Pod on a real kube-apiserver v1.20.2 on loopback. Open it once."""

    lacks: Mapping[Capability, str] = {
        **KubernetesStage.lacks,
        Capability.DEVICES: realserver.NO_DRA,
    }

    def __init__(self) -> None:
        super().__init__()
        self._real: realserver.RealApiServer | None = None
        self._uid = ""  # the Pod's UID, read at open: launch never asks a silenced apiserver

    @property
    def real(self) -> realserver.RealApiServer:
        return while_open(self._real)

    async def open(self, workdir: Path, issuer: Issuer) -> None:
        """Start etcd and the apiserver, create the Pod, lay out its volumes (a bound token)."""
        self.opened(workdir, issuer)
        why = await asyncio.to_thread(realserver.missing)
        if why is not None:
            raise StageCannot(why)
        server = realserver.RealApiServer(workdir / "apiserver")
        self._real = server
        try:
            await asyncio.to_thread(server.start)
            pod = await asyncio.to_thread(server.create_pod, POD, node=NODE,
                                          service_account=SERVICE_ACCOUNT,
                                          claims={"gpus": CLAIM})
            token = await asyncio.to_thread(server.bound_token, POD)
        except BaseException:
            await self.close()  # the runner closes only a stage that opened
            raise
        self._uid = str(pod["metadata"]["uid"])
        account = workdir / "serviceaccount"
        account.mkdir()
        (account / "token").write_text(token)
        (account / "ca.crt").write_bytes(server.ca_pem)
        (account / "namespace").write_text(NAMESPACE)
        self.volume.mkdir(mode=0o755)
        (workdir / "state").mkdir(mode=0o700)

    async def close(self) -> None:
        """Stop the apiserver and etcd, remove their files. Never raises."""
        if self._real is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._real.close)
            self._real = None

    def launch(self) -> Launch:
        base = super().launch()
        return Launch(base.config, {**base.environ, ENV_POD_UID: self._uid})

    def _api_env(self) -> dict[str, str]:
        return {"KUBERNETES_SERVICE_HOST": realserver.HOST,
                "KUBERNETES_SERVICE_PORT": str(self.real.port)}

    async def silence(self) -> None:
        """SIGSTOP the apiserver: nothing answers (rounds time out) until ``restore``."""
        self.real.pause()

    async def restore(self) -> None:
        """SIGCONT the apiserver."""
        self.real.resume()

    async def lose_scope(self) -> None:
        """Delete the grant Pod through the API (graceful; no kubelet finishes it)."""
        await asyncio.to_thread(self.real.delete_pod, POD, force=False)

    def readiness(self) -> Published:
        """The Pod's gate condition now; each state a status PATCH answered 200 set (audit log)."""
        history = tuple(
            state for event in self.real.audit_events()
            if event.get("verb") == "patch" and event.get("stage") == "ResponseComplete"
            and (event.get("objectRef") or {}).get("subresource") == "status"
            and (event.get("objectRef") or {}).get("name") == POD
            and (event.get("responseStatus") or {}).get("code") == 200
            for state in [condition_sent(json.dumps(event.get("requestObject")).encode())]
            if state is not None)
        return Published(self._condition(), history)

    def devices(self) -> tuple[Device, ...]:
        raise NotImplementedError(realserver.NO_DRA)

    def _condition(self) -> bool | None:
        pod = self.real.pod(POD)
        for condition in (pod or {}).get("status", {}).get("conditions", []) or []:
            if condition.get("type") == DEFAULT_GATE:
                return {"True": True, "False": False}.get(condition.get("status"))
        return None


class KilledRealKubernetesStage(RealKubernetesStage):
    """The real lane whose silence kills the apiserver (restore starts it again, same port)."""

    async def silence(self) -> None:
        """SIGKILL the apiserver: connections are refused until ``restore``."""
        await asyncio.to_thread(self.real.kill)

    async def restore(self) -> None:
        """Start the apiserver again on its port and wait until it is ready (several seconds)."""
        await asyncio.to_thread(self.real.revive)
