"""A real kube-apiserver (and etcd) on loopback, for tests and the conform stage's real lane.

``RealApiServer`` starts Debian's ``etcd`` and the kube-apiserver binary that
``deploy/kubernetes/real-apiserver/build`` built (upstream v1.20.2 from
Debian's source package, cached outside the repository) on 127.0.0.1 only,
each on a free port, with their own CA and serving certificate, a service
account signing key (so TokenRequest mints Pod-bound tokens), RBAC
authorization, an admin static token in ``system:masters``, an audit log of
every request, and the ServiceAccount admission plugin disabled (no
controller-manager makes the ``default`` account). ``start`` returns once
``/readyz`` answers, then applies ``deploy/kubernetes/rbac.yaml`` unchanged
(namespace ``grants``) and a CustomResourceDefinition standing in for
``resource.k8s.io/v1`` ResourceClaim (v1.20 has no DRA; its Pod type drops
``spec.resourceClaims``). The ``admin`` helpers then create, read, replace
and delete grant Pods, and mint tokens bound to one.

``binary()`` finds the built apiserver (``SLURM_FIBER_KUBE_APISERVER``, else
the build script's cache) or None: callers say what is missing, never skip
silently. Blocking (subprocesses, HTTP); not for an event loop's thread.
``close`` stops both processes (SIGCONT first, should they be stopped) and
removes the work directory; it never raises.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx2
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from slurm_fiber.testing.kubernetes.fake.rbac import RBAC_MANIFEST, load_manifest
from slurm_fiber.testing.kubernetes.fake.tls import mint_serving_cert

CHECKOUT = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = CHECKOUT / "deploy" / "kubernetes" / "real-apiserver" / "build"
ENV_BINARY = "SLURM_FIBER_KUBE_APISERVER"
ETCD = "/usr/bin/etcd"
READY_TIMEOUT = 90.0  # seconds for /readyz (6-8 s on 2 idle cores)
ADMIN_TOKEN_BYTES = 24
HOST = "127.0.0.1"
NAMESPACE = "grants"
CRD_NAME = "resourceclaims.resource.k8s.io"
# Why the real lane cannot show devices.provisioned (Issue 16, Deliver 4).
NO_DRA = ("kube-apiserver v1.20.2 has no DRA: its Pod type drops spec.resourceClaims, "
          "resources.claims and status.resourceClaimStatuses, so no Pod can name the "
          "ResourceClaim (a CRD stand-in) whose devices fiberd would provision")


class RealServerError(RuntimeError):
    """The real API server could not be started or did not answer as expected (one line)."""


def binary() -> Path | None:
    """The kube-apiserver to run: ``$SLURM_FIBER_KUBE_APISERVER``, else the build's cache."""
    override = os.environ.get(ENV_BINARY, "").strip()
    if override:
        return Path(override) if os.access(override, os.X_OK) else None
    if not BUILD_SCRIPT.exists():
        return None
    found = subprocess.run([str(BUILD_SCRIPT), "--path"], capture_output=True, text=True,
                           timeout=60, check=False)
    path = found.stdout.strip()
    return Path(path) if found.returncode == 0 and path else None


def missing() -> str | None:
    """Why a real API server cannot run here (one line), or None when it can."""
    if binary() is None:
        return (f"no kube-apiserver built: run {BUILD_SCRIPT.relative_to(CHECKOUT)} "
                f"(or set {ENV_BINARY})")
    if not os.access(ETCD, os.X_OK):
        return f"{ETCD} is missing: apt-get install etcd-server"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


class RealApiServer:
    """etcd + kube-apiserver on 127.0.0.1; ``start`` once, ``close`` when done."""

    def __init__(self, workdir: Path | None = None) -> None:
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="slurm-fiber-kube-real-"))
        self.port = 0
        self.ca_pem = b""
        self.admin_token = ""
        self._procs: list[subprocess.Popen[bytes]] = []
        self._http: httpx2.Client | None = None

    @property
    def url(self) -> str:
        return f"https://{HOST}:{self.port}"

    @property
    def audit_log(self) -> Path:
        return self.dir / "audit.log"

    @property
    def apiserver_pid(self) -> int:
        return self._procs[-1].pid

    # -- life cycle ------------------------------------------------------------

    def start(self) -> RealApiServer:
        """Start etcd and the apiserver, wait for ``/readyz``, apply RBAC and the claim CRD.

        Raises RealServerError with the apiserver log's tail when it does not
        come up within READY_TIMEOUT.
        """
        apiserver = binary()
        if apiserver is None:
            raise RealServerError(missing() or "no kube-apiserver")
        self.dir.mkdir(parents=True, exist_ok=True)
        cert = mint_serving_cert(HOST)
        self.ca_pem = cert.ca_pem
        self.admin_token = os.urandom(ADMIN_TOKEN_BYTES).hex()
        files = {"ca.crt": cert.ca_pem, "tls.crt": cert.cert_pem, "tls.key": cert.key_pem,
                 "tokens.csv": f'{self.admin_token},slurm-fiber-admin,admin,"system:masters"\n'
                 .encode(), "audit-policy.yaml": b"apiVersion: audit.k8s.io/v1\nkind: Policy\n"
                 b"rules:\n- level: Request\n"}
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        files["sa.key"] = sa_key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption())
        files["sa.pub"] = sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        for name, data in files.items():
            path = self.dir / name
            path.write_bytes(data)
            path.chmod(0o600)
        etcd_port, peer_port = _free_port(), _free_port()
        self.port = _free_port()
        self._spawn("etcd", [
            ETCD, "--name", "default", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", f"http://{HOST}:{etcd_port}",
            "--advertise-client-urls", f"http://{HOST}:{etcd_port}",
            "--listen-peer-urls", f"http://{HOST}:{peer_port}",
            "--initial-advertise-peer-urls", f"http://{HOST}:{peer_port}",
            "--initial-cluster", f"default=http://{HOST}:{peer_port}",
            "--listen-metrics-urls", f"http://{HOST}:{_free_port()}",
        ])
        d = self.dir
        self._spawn("kube-apiserver", [
            str(apiserver), f"--etcd-servers=http://{HOST}:{etcd_port}",
            f"--bind-address={HOST}", f"--advertise-address={HOST}",
            f"--secure-port={self.port}", "--insecure-port=0",
            f"--tls-cert-file={d / 'tls.crt'}", f"--tls-private-key-file={d / 'tls.key'}",
            f"--client-ca-file={d / 'ca.crt'}", f"--cert-dir={d / 'certs'}",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--api-audiences=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=RBAC", f"--token-auth-file={d / 'tokens.csv'}",
            "--disable-admission-plugins=ServiceAccount",
            "--service-cluster-ip-range=10.96.0.0/24", "--endpoint-reconciler-type=none",
            f"--audit-log-path={self.audit_log}", f"--audit-policy-file={d / 'audit-policy.yaml'}",
            "--audit-log-mode=blocking", "--profiling=false", "--logtostderr=true", "--v=1",
        ])
        self._http = httpx2.Client(base_url=self.url,
                                   verify=ssl.create_default_context(cafile=self.dir / "ca.crt"),
                                   headers={"Authorization": f"Bearer {self.admin_token}"},
                                   timeout=10.0)
        self._wait_ready()
        self._setup()
        return self

    def close(self) -> None:
        """Stop the apiserver, then etcd; remove the work directory. Idempotent, never raises."""
        if self._http is not None:
            with contextlib.suppress(Exception):
                self._http.close()
            self._http = None
        for proc in reversed(self._procs):
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        self._procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RealApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pause(self) -> None:
        """SIGSTOP the apiserver: connections open but nothing answers (a hung control plane)."""
        os.kill(self.apiserver_pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the apiserver after ``pause``."""
        os.kill(self.apiserver_pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the apiserver (connections refused); etcd and its data live on. Idempotent."""
        proc = self._procs[-1]
        proc.kill()
        proc.wait(timeout=15)

    def revive(self) -> None:
        """Start the apiserver again after ``kill`` (same port, same etcd); waits for /readyz.

        A no-op while it runs.
        """
        if self._procs[-1].poll() is None:
            return
        proc = self._procs.pop()
        self._spawn("kube-apiserver", [str(a) for a in proc.args])  # type: ignore[union-attr]
        self._wait_ready()

    # -- the admin's side ------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
        """One admin request; returns the status code and the JSON body."""
        http = self._client()
        answer = http.request(method, path, content=None if body is None else json.dumps(body),
                              headers={"Content-Type": content_type})
        try:
            document = answer.json()
        except ValueError:
            document = {"raw": answer.text}
        return answer.status_code, document

    def must(self, method: str, path: str, body: Any = None, *, ok: tuple[int, ...] = (200, 201),
             content_type: str = "application/json") -> dict[str, Any]:
        """``request``, raising RealServerError unless the code is in ``ok``."""
        code, document = self.request(method, path, body, content_type)
        if code not in ok:
            raise RealServerError(f"{method} {path}: {code} {document.get('message', document)}")
        return document

    def create_pod(self, name: str, *, service_account: str = "slurm-fiber",
                   node: str = "node-1", gate: str | None = "slurm-fiber.io/template-warm",
                   claims: dict[str, str] | None = None) -> dict[str, Any]:
        """Create a grant Pod (bound to ``node``, never run: there is no kubelet); returns it."""
        spec: dict[str, Any] = {
            "nodeName": node, "serviceAccountName": service_account,
            "containers": [{"name": "fiberd", "image": "slurm-fiber:test"}],
        }
        if gate:
            spec["readinessGates"] = [{"conditionType": gate}]
        if claims:  # dropped by v1.20: kept so the Pod is the manifest's, as far as it goes
            spec["resourceClaims"] = [{"name": k, "resourceClaimName": v}
                                      for k, v in claims.items()]
        return self.must("POST", f"/api/v1/namespaces/{NAMESPACE}/pods",
                         {"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec})

    def pod(self, name: str) -> dict[str, Any] | None:
        """The Pod now, or None when it does not exist."""
        code, document = self.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        if code == 404:
            return None
        if code != 200:
            raise RealServerError(f"read pod {name}: {code}")
        return document

    def delete_pod(self, name: str, *, force: bool) -> None:
        """Delete the Pod: ``force`` removes it now (grace 0), else it keeps a deletionTimestamp."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if force:
            body["gracePeriodSeconds"] = 0  # type: ignore[assignment]
        self.must("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}", body)
        if force:
            deadline = time.monotonic() + 30
            while self.pod(name) is not None:
                if time.monotonic() > deadline:
                    raise RealServerError(f"pod {name} still exists 30 s after a forced delete")
                time.sleep(0.05)

    def replace_pod(self, name: str) -> dict[str, Any]:
        """Force-delete the Pod and create another under its name (a new UID); returns it."""
        self.delete_pod(name, force=True)
        return self.create_pod(name)

    def bound_token(self, pod: str, *, service_account: str = "slurm-fiber",
                    seconds: int = 3600) -> str:
        """A TokenRequest for the service account bound to the Pod as it is now (its UID)."""
        current = self.pod(pod)
        if current is None:
            raise RealServerError(f"no pod {pod} to bind a token to")
        answer = self.must(
            "POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{service_account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
             "spec": {"expirationSeconds": seconds,
                      "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod,
                                         "uid": current["metadata"]["uid"]}}})
        return str(answer["status"]["token"])

    def audit_events(self) -> Iterator[dict[str, Any]]:
        """The audit log's events so far, oldest first (unreadable lines skipped)."""
        try:
            lines = self.audit_log.read_text().splitlines()
        except FileNotFoundError:
            return
        for line in lines:
            with contextlib.suppress(ValueError):
                yield json.loads(line)

    # -- inside ----------------------------------------------------------------

    def _client(self) -> httpx2.Client:
        if self._http is None:
            raise RealServerError("the real API server is not started")
        return self._http

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.dir / f"{name}.log").open("ab")
        self._procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    program = cast("list[str]", proc.args)[0]
                    raise RealServerError(f"{program} exited {proc.returncode}: "
                                          f"{self._tail()}")
            with contextlib.suppress(httpx2.HTTPError):
                if self._client().get("/readyz").status_code == 200:
                    return
            time.sleep(0.2)
        raise RealServerError(f"/readyz not ok after {READY_TIMEOUT:.0f} s: {self._tail()}")

    def _tail(self) -> str:
        try:
            text = (self.dir / "kube-apiserver.log").read_text(errors="replace")
        except OSError:
            return "no log"
        return " | ".join(text.strip().splitlines()[-5:])

    def _setup(self) -> None:
        self.must("POST", "/api/v1/namespaces",
                  {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        for obj in load_manifest(RBAC_MANIFEST):  # unchanged: the objects as shipped
            self.must("POST", _collection(obj), obj)
        self.must("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", {
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": CRD_NAME, "annotations": {
                "api-approved.kubernetes.io": "unapproved, a test stand-in for DRA"}},
            "spec": {"group": "resource.k8s.io", "scope": "Namespaced",
                     "names": {"plural": "resourceclaims", "singular": "resourceclaim",
                               "kind": "ResourceClaim"},
                     "versions": [{"name": "v1", "served": True, "storage": True,
                                   "subresources": {"status": {}},
                                   "schema": {"openAPIV3Schema": {
                                       "type": "object",
                                       "x-kubernetes-preserve-unknown-fields": True}}}]}})
        deadline = time.monotonic() + 30
        path = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/none"
        while self.request("GET", path)[0] != 404:  # served once established
            if time.monotonic() > deadline:
                raise RealServerError("the ResourceClaim CRD was not served within 30 s")
            time.sleep(0.1)


def _collection(obj: dict[str, Any]) -> str:
    """The collection path to POST a manifest object to."""
    version = obj["apiVersion"]
    base = f"/api/{version}" if "/" not in version else f"/apis/{version}"
    plural = {"ServiceAccount": "serviceaccounts", "Role": "roles",
              "RoleBinding": "rolebindings"}[obj["kind"]]
    return f"{base}/namespaces/{obj['metadata']['namespace']}/{plural}"


def main() -> int:
    """Start one (build it first if needed), print how to reach it, serve until SIGINT/SIGTERM."""
    if binary() is None:
        print(f"building kube-apiserver with {BUILD_SCRIPT} (minutes, once)", flush=True)
        subprocess.run([str(BUILD_SCRIPT)], check=True, stdout=subprocess.DEVNULL)
    server = RealApiServer()
    try:
        server.start()
        (server.dir / "admin.token").write_text(server.admin_token)
        print(f"kube-apiserver v1.20.2 at {server.url}\n  CA: {server.dir / 'ca.crt'}\n"
              f"  admin token (system:masters): {server.dir / 'admin.token'}\n"
              f"  namespace {NAMESPACE}: rbac.yaml applied, ResourceClaim CRD stand-in\n"
              f"  logs and audit log: {server.dir}", flush=True)
        stops = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # after the children started
        signal.sigwait(stops)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
