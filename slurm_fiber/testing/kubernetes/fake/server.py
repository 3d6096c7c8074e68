"""The fake Kubernetes API server: the home's slice of the API over real HTTP(S) on 127.0.0.1.

``FakeApiServer`` serves, from a ``Store`` in memory, what the Kubernetes home
calls: Pods (get, patch, delete, and the ``status`` subresource: get and
patch) and ``resource.k8s.io/v1`` ResourceClaims (get, patch, delete, and
their ``status``). It behaves like the real server where the home can tell:

- authentication: ``Authorization: Bearer <token>`` with a static token
  (``tokens``: the service account's, ``token``, and an admin's,
  ``admin_token``, in ``system:masters``) or a Pod-bound token
  (``bound_token``), 401 otherwise. A bound token is valid while its Pod
  exists with the UID it was minted for (a Pod deleting for more than 60 s
  invalidates it, as upstream's validator does); like the real server's
  token cache, a successful check is trusted for ``TOKEN_CACHE_TTL`` (10 s)
  on the server's clock, so a replaced Pod's token still reads for up to
  10 s and then gets 401.
- authorization: RBAC from the Role and RoleBinding objects of
  ``deploy/kubernetes/rbac.yaml`` (or ``rbac=``), checked before routing: a
  request they do not allow gets 403 with the real ``Status`` message, on
  any path (lists, Secrets, deletes), as it does upstream.
- answers are sent with TCP_NODELAY, so a round costs what the real server's
  does (without it, headers and body in two writes stall on delayed ACKs).
- errors are ``Status`` objects like the real server's; the store's write
  rules are the real ones (see ``store``).

By default it speaks TLS with a CA it mints, so a client configured the
in-cluster way (service account token, ``ca.crt``,
``KUBERNETES_SERVICE_HOST``/``_PORT``) talks to it unchanged.

Fault modes for tests: ``inject`` answers the next requests with 404, 409,
410, 500 (or any code); ``set_delay`` holds every answer (slow);
``stop`` makes it dead (connection refused, open connections dropped) and
``start`` brings it back on the same port. The server runs on its own
threads, so it serves asyncio and blocking clients alike; ``close`` stops
it and removes its files. Not for production: it checks only what the home
relies on.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shutil
import socket
import ssl
import sys
import tempfile
import threading
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from slurm_fiber.core.clock import Clock, SystemClock
from slurm_fiber.testing.kubernetes.fake.rbac import (
    ADMIN,
    Attributes,
    Principal,
    Rbac,
    forbidden,
    load_manifest,
)
from slurm_fiber.testing.kubernetes.fake.store import KINDS, PODS, ApiStatus, Kind, Store
from slurm_fiber.testing.kubernetes.fake.tls import mint_serving_cert

ROUTE = re.compile(
    r"^(?P<prefix>/api/v1|/apis/(?P<group>[^/]+)/[^/]+)(?:/namespaces/(?P<namespace>[^/]+))?"
    r"/(?P<plural>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)
KIND_BY_ROUTE: dict[tuple[str, str], Kind] = {(k.prefix, k.plural): k for k in KINDS}
VERBS = {"GET": "get", "HEAD": "get", "POST": "create", "PUT": "update", "PATCH": "patch",
         "DELETE": "delete"}
TOKEN_CACHE_TTL = 10.0  # seconds a successful token check is trusted (the apiserver's cache)
DELETED_POD_TOKEN_GRACE = 60.0  # a deleting Pod's token stays valid this long past deletion


@dataclass(frozen=True)
class BoundToken:
    """A service account token bound to one Pod, by UID."""

    principal: Principal
    namespace: str
    pod: str
    uid: str


def request_attributes(method: str, route: re.Match[str], query: str) -> Attributes:
    """The authorizer's view of a routed request (list/watch/deletecollection on collections)."""
    verb = VERBS.get(method, method.lower())
    if route["name"] is None:
        if verb == "get":
            verb = "watch" if parse_qs(query).get("watch", ["0"])[0] in ("1", "true") else "list"
        elif verb == "delete":
            verb = "deletecollection"
    return Attributes(verb, route["group"] or "", route["plural"], route["sub"] or "",
                      route["namespace"], route["name"])


@dataclass(frozen=True)
class Seen:
    """One request the server answered: method, path, patch content type, status code, body."""

    method: str
    path: str
    content_type: str
    code: int
    body: bytes = b""


@dataclass
class Fault:
    """An injected answer: ``code`` for the next ``times`` matching requests (None: always)."""

    code: int
    times: int | None
    method: str | None
    plural: str | None

    def matches(self, method: str, plural: str | None) -> bool:
        return (self.method is None or self.method == method) and (
            self.plural is None or self.plural == plural
        )


class FakeApiServer:
    """An in-memory API server on 127.0.0.1; start/stop/close from any thread, never blocks long.

    ``token`` is the static token of the service account
    ``service_account`` (namespace, name), whose rights are RBAC's;
    ``admin_token`` may do anything. ``tokens`` maps every static token to
    its principal (add, remove: effective at once). ``clock`` stamps deletion
    and creation times and times the token cache (a FakeClock in tests);
    ``rbac`` the RBAC objects (default: ``deploy/kubernetes/rbac.yaml``);
    ``tls=False`` serves plain HTTP.
    """

    def __init__(
        self, *, token: str = "fake-sa-token", clock: Clock | None = None, tls: bool = True,
        service_account: tuple[str, str] = ("grants", "slurm-fiber"),
        rbac: list[dict[str, Any]] | None = None,
    ) -> None:
        self.clock = clock or SystemClock()
        self.store = Store(self.clock)
        self.rbac = Rbac(load_manifest() if rbac is None else rbac)
        self.service_account = service_account
        self.token = token
        self.admin_token = "fake-admin-token"
        self.tokens: dict[str, Principal] = {
            token: Principal.service_account(*service_account), self.admin_token: ADMIN}
        self._bound: dict[str, BoundToken] = {}
        self._trusted_until: dict[str, float] = {}  # the token cache: token -> mono expiry
        self.host = "127.0.0.1"
        self.port = 0
        self._dir = Path(tempfile.mkdtemp(prefix="slurm-fiber-fake-api-"))
        self._tls: ssl.SSLContext | None = None
        self.ca_pem = b""
        if tls:
            cert = mint_serving_cert(self.host)
            self.ca_pem = cert.ca_pem
            (self._dir / "tls.crt").write_bytes(cert.cert_pem)
            (self._dir / "tls.key").write_bytes(cert.key_pem)
            self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._tls.load_cert_chain(self._dir / "tls.crt", self._dir / "tls.key")
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._delay = 0.0
        self._wake = threading.Event()
        self._seen: list[Seen] = []
        self._http: _Http | None = None
        self._thread: threading.Thread | None = None

    # -- life cycle ------------------------------------------------------------

    @property
    def url(self) -> str:
        """Where clients reach it, e.g. ``https://127.0.0.1:41234``."""
        return f"{'https' if self._tls else 'http'}://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether it is listening (False before ``start`` and after ``stop``)."""
        return self._http is not None

    def start(self) -> FakeApiServer:
        """Listen (again, on the same port after ``stop``) and serve on a thread. Idempotent."""
        with self._lock:
            if self._http is not None:
                return self
            self._wake.clear()
            self._http = _Http((self.host, self.port), self)
            self.port = self._http.server_address[1]
            self._thread = threading.Thread(
                target=self._http.serve_forever,
                kwargs={"poll_interval": 0.02},
                name="fake-kube-api",
                daemon=True,
            )
            self._thread.start()
            return self

    def stop(self) -> None:
        """Go dead: stop listening, drop open connections; returns once the listener is shut."""
        with self._lock:
            http, thread = self._http, self._thread
            self._http = self._thread = None
        if http is None:
            return
        self._wake.set()
        http.drop_connections()  # first: from here on nothing is answered
        http.shutdown()
        http.server_close()
        if thread is not None:
            thread.join()

    def close(self) -> None:
        """Stop for good and remove the server's files. Idempotent."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- fault modes -----------------------------------------------------------

    def inject(
        self,
        code: int,
        *,
        times: int | None = 1,
        method: str | None = None,
        resource: str | None = None,
    ) -> None:
        """Answer the next ``times`` requests (``method`` on ``resource``, "pods") with ``code``."""
        with self._lock:
            self._faults.append(Fault(code, times, method, resource))

    def set_delay(self, seconds: float) -> None:
        """Hold every answer ``seconds`` before sending it (0: at once); ``stop`` cuts it short."""
        with self._lock:
            self._delay = max(0.0, seconds)

    def clear_faults(self) -> None:
        """Drop injected answers and the delay."""
        with self._lock:
            self._faults.clear()
            self._delay = 0.0

    @property
    def seen(self) -> list[Seen]:
        """The requests answered so far, oldest first (a copy)."""
        with self._lock:
            return list(self._seen)

    # -- how a Pod finds it ----------------------------------------------------

    def in_cluster_env(self) -> dict[str, str]:
        """The service-discovery variables the kubelet gives every container, pointing here."""
        return {"KUBERNETES_SERVICE_HOST": self.host, "KUBERNETES_SERVICE_PORT": str(self.port)}

    def bound_token(self, namespace: str, pod: str) -> str:
        """Mint a token of the Pod's service account bound to the Pod as it is now (its UID).

        Raises ApiStatus(404) when there is no such Pod. The principal is the
        Pod's ``spec.serviceAccountName`` (``default`` when unset).
        """
        obj = self.store.get(PODS, namespace, pod)
        account = obj.get("spec", {}).get("serviceAccountName") or "default"
        token = f"fake-bound-{secrets.token_hex(16)}"
        with self._lock:
            self._bound[token] = BoundToken(Principal.service_account(namespace, account),
                                            namespace, pod, obj["metadata"]["uid"])
        return token

    def write_service_account(self, directory: Path, namespace: str, *,
                              token: str | None = None) -> Path:
        """Lay out a projected service account volume (token, ca.crt, namespace) for this server.

        ``token`` defaults to the service account's static ``token``.
        """
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "token").write_text(token or self.token)
        (directory / "ca.crt").write_bytes(self.ca_pem)
        (directory / "namespace").write_text(namespace)
        return directory

    # -- used by the request threads ---------------------------------------------

    def _take_fault(self, method: str, plural: str | None) -> tuple[float, int | None]:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, plural):
                    if fault.times is not None:
                        fault.times -= 1
                        if fault.times <= 0:
                            self._faults.remove(fault)
                    return self._delay, fault.code
            return self._delay, None

    def _authenticate(self, authorization: str) -> Principal:
        """Who the bearer is; ApiStatus(401) when no token of this server says so."""
        token = authorization.removeprefix("Bearer ") if authorization.startswith("Bearer ") \
            else None
        with self._lock:
            principal = self.tokens.get(token) if token else None
            bound = self._bound.get(token) if token else None
            trusted = token is not None and self._trusted_until.get(token, -1.0) > self.clock.mono()
        if principal is not None:
            return principal
        if bound is None or token is None:
            raise ApiStatus(401, "Unauthorized")
        if trusted:
            return bound.principal
        try:
            pod = self.store.get(PODS, bound.namespace, bound.pod)
        except ApiStatus:
            raise ApiStatus(401, "Unauthorized") from None
        deleting = pod["metadata"].get("deletionTimestamp")
        if pod["metadata"]["uid"] != bound.uid or (
                deleting is not None
                and _wall_of(deleting) + DELETED_POD_TOKEN_GRACE < self.clock.wall()):
            raise ApiStatus(401, "Unauthorized")
        with self._lock:
            self._trusted_until[token] = self.clock.mono() + TOKEN_CACHE_TTL
        return bound.principal

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)

    def _answer(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, Any]] | None:
        """The status code and JSON body for one request, or None when the server went dead."""
        url = urlsplit(path)
        route = ROUTE.match(url.path)
        kind = KIND_BY_ROUTE.get((route["prefix"], route["plural"])) if route else None
        delay, fault_code = self._take_fault(method, kind.plural if kind else None)
        if delay and self._wake.wait(delay):
            return None
        try:
            who = self._authenticate(headers.get("authorization", ""))
            if route is not None:
                request = request_attributes(method, route, url.query)
                if not self.rbac.allows(who, request):
                    raise ApiStatus(403, forbidden(who, request), name=request.name or "",
                                    kind=request.resource)
            if fault_code is not None:
                raise ApiStatus(fault_code, f"injected fault {fault_code}")
            if route is None or kind is None or route["namespace"] is None \
                    or route["sub"] not in (None, "status"):
                raise ApiStatus(404, "the server could not find the requested resource")
            return 200, self._serve(kind, route, method, headers, body)
        except ApiStatus as refusal:
            return refusal.code, refusal.body()
        except Exception as bug:  # a fake's bug answers 500, as the real server's would
            return 500, ApiStatus(500, f"fake API server error: {bug!r}").body()

    def _serve(
        self, kind: Kind, route: re.Match[str], method: str, headers: dict[str, str], body: bytes
    ) -> dict[str, Any]:
        namespace, name, status_only = route["namespace"], route["name"], bool(route["sub"])
        if name is None:
            raise ApiStatus(405, f"the fake serves single {kind.plural}, not collections")
        if method == "GET":
            return self.store.get(kind, namespace, name)
        if method == "PATCH":
            content_type = headers.get("content-type", "")
            return self.store.patch(
                kind, namespace, name, content_type, body, status_only=status_only
            )
        if method == "DELETE" and not status_only:
            return self.store.delete(kind, namespace, name)
        raise ApiStatus(405, f"{method} is not supported on this path")


class _Http(ThreadingHTTPServer):
    """The listener: a thread per connection (TLS handshake included), open connections tracked."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], fake: FakeApiServer) -> None:
        self.fake = fake
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self.stopped = False  # set by drop_connections: nothing is answered after it
        super().__init__(address, _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # Headers and body leave in separate writes: without NODELAY the body waits for
        # the client's delayed ACK (tens of ms a request), which the real server never does.
        with contextlib.suppress(OSError):
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.fake._tls is not None:
            try:
                request = self.fake._tls.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                request.close()
                return
        with self._open_lock:
            if self.stopped:  # accepted (or handshaking) while the server went dead
                request.close()
                return
            self._open.add(request)
        try:
            super().finish_request(request, client_address)
        finally:
            with self._open_lock:
                self._open.discard(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up mid-answer (fiberd stopping) is normal: no traceback for it."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def connections(self) -> list[socket.socket]:
        """The connections open now (TLS handshake done), for tests to inspect."""
        with self._open_lock:
            return list(self._open)

    def drop_connections(self) -> None:
        """Go dead for good: close every open connection and answer nothing more."""
        with self._open_lock:
            self.stopped = True
            conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Http

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the fake keeps its own record in ``FakeApiServer.seen``."""

    def _handle(self) -> None:
        if self.server.stopped:  # a keep-alive request that raced the stop: hang up
            self.close_connection = True
            return
        headers = {k.lower(): v for k, v in self.headers.items()}
        length = headers.get("content-length", "0")
        body = b""
        if not length.isdigit():
            answer: tuple[int, dict[str, Any]] | None = (
                400, ApiStatus(400, f"bad Content-Length {length!r}").body())
            self.close_connection = True
        else:
            body = self.rfile.read(int(length)) if int(length) else b""
            answer = self.server.fake._answer(self.command, self.path, headers, body)
        if answer is None:
            self.close_connection = True
            return
        code, document = answer
        # Recorded before the answer leaves, so a client that has its answer finds it in seen.
        self.server.fake._record(
            Seen(self.command, self.path, headers.get("content-type", ""), code, body)
        )
        payload = json.dumps(document).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PATCH = do_DELETE = do_POST = do_PUT = _handle


def _wall_of(stamp: str) -> float:
    """Seconds since the epoch of an RFC 3339 ``...Z`` stamp."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
