"""A throwaway standalone site: an issuer, one grant, and a real ``fiberd`` subprocess.

Used by ``slurm-fiber quickstart`` and bench/clone.py. ``Site.create(root,
preloads)`` makes, under ``root`` (mode 0700), a
``slurm_fiber.testing.Site``: a fresh Ed25519 issuer key (kept in memory
only), its JWKS, and one grant token (or one per given UID) whose template
preloads the given modules, dropped into the standalone home's grantdir.
``Site.start`` runs the ``fiberd`` console script of this interpreter's
environment (the same venv) with flags only: the caller's ``FIBERD_*``
variables and systemd's ``NOTIFY_SOCKET`` are not passed on, so nothing
outside ``root`` configures it or hears from it. Every template and fiber
carries ``SLURM_FIBER_RUN=<run id>`` in its environment, which is how
``Site.leftovers`` finds any process of this run still alive after the stop.
Nothing here needs root.

All methods block. Failures raise ``SiteFailed`` with one line a person can act on.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from slurm_fiber import testing
from slurm_fiber.client.connection import FiberdClient, Refused, Unreachable
from slurm_fiber.core.trust.grant import FiberSpec, Limits, TemplateSpec
from slurm_fiber.defaults import AUDIT_NAME, SOCKET_NAME
from slurm_fiber.procs import marked

ISSUER = "quickstart-issuer"
AUDIENCE = "quickstart"
GRANT = "quickstart"
RUN_MARK = "SLURM_FIBER_RUN"
TOKEN_TTL = 3600.0
POLL = 0.05


class SiteFailed(Exception):
    """The throwaway site or its fiberd did not do what it should (one line)."""


def fiberd_command() -> list[str]:
    """The ``fiberd`` console script beside this interpreter (the same environment)."""
    script = Path(sys.executable).parent / "fiberd"
    if not os.access(script, os.X_OK):
        raise SiteFailed(f"no fiberd beside {sys.executable}; install slurm_fiber into this "
                         "environment (./dev setup)")
    return [str(script)]


def child_env(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` without what would configure fiberd or its readiness from outside."""
    return {k: v for k, v in environ.items()
            if not k.startswith("FIBERD_") and k != "NOTIFY_SOCKET"}


@dataclass
class Site:
    """One throwaway site under ``root``; ``proc`` is its fiberd once started, on cgroup
    ``backend`` (fiberd's ``--cgroup-backend``)."""

    root: Path
    preloads: tuple[str, ...]
    run_id: str = field(default_factory=lambda: secrets.token_hex(6))
    backend: str = "auto"
    proc: subprocess.Popen[bytes] | None = None
    options: dict[str, str] = field(default_factory=dict)  # more fiberd flags, e.g. task-window

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def socket(self) -> Path:
        return self.state / SOCKET_NAME

    @property
    def audit_path(self) -> Path:
        return self.root / AUDIT_NAME

    @property
    def log_path(self) -> Path:
        return self.root / "fiberd.log"

    @classmethod
    def create(cls, root: Path, preloads: Sequence[str], limits: Limits | None = None,
               uids: Sequence[str] = (GRANT,)) -> Site:
        """Write the issuer's JWKS and a grant per UID in ``uids`` (one, ``quickstart``, by
        default; with ``limits``, if given) into a new layout under ``root``."""
        site = cls(root, tuple(preloads))
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        root.chmod(0o700)
        grants = testing.Site(root, issuer=ISSUER, audience=AUDIENCE,
                              jwks_name="issuer.jwks.json")
        spec = FiberSpec(template=TemplateSpec(preload=site.preloads,
                                               env={RUN_MARK: site.run_id}),
                         limits=limits or Limits())
        for uid in uids:
            grants.drop_token(uid, grants.mint(uid, spec, ttl=TOKEN_TTL))
        return site

    def flags(self, cgroup_root: str) -> list[str]:
        options = {
            "home": "standalone", "state-dir": str(self.state),
            "audit-path": str(self.audit_path),
            "trust": f"{ISSUER}={self.root / 'issuer.jwks.json'}", "audience": AUDIENCE,
            "poll-interval": "0.1", "grace": "1", "cgroup-root": cgroup_root,
            "cgroup-backend": self.backend, "ready-file": "none", **self.options,
        }
        if os.geteuid() == 0:
            # A throwaway site lives in root's private dir with this interpreter, which no
            # other account may run: its fibers stay root's, said explicitly as a site
            # would (fiber_user; a real root fiberd names an unprivileged account).
            options["fiber-user"] = "root"
        return [f"--{k}={v}" for k, v in options.items()]

    def start(self, cgroup_root: str = "delegate", within: float = 30.0) -> None:
        """Start fiberd and return once its socket answers. Raises SiteFailed."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([*fiberd_command(), *self.flags(cgroup_root)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env=child_env(dict(os.environ)))
        end = time.monotonic() + within
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise SiteFailed(f"fiberd exited with status {self.proc.returncode}: "
                                 f"{self.last_log_line()}")
            if time.monotonic() > end:
                raise SiteFailed(f"fiberd did not listen within {within:g} s (log {self.log_path})")
            time.sleep(POLL)

    def request(self, op: str) -> dict[str, object]:
        """One request to this site's fiberd; its result. Raises SiteFailed."""
        try:
            with FiberdClient(self.socket, timeout=10.0) as client:
                return client.request(op)
        except (Unreachable, Refused) as err:
            raise SiteFailed(f"fiberd did not answer {op}: {err}") from None

    def wait_warm(self, within: float, progress: Callable[[str, float], None]) -> float:
        """Block until the grant's template is ready; the seconds it took.

        Calls ``progress(state, seconds)`` about every 0.1 s while warming.
        Raises SiteFailed when it fails to warm, fiberd dies, or ``within`` passes.
        """
        start = time.monotonic()
        while True:
            elapsed = time.monotonic() - start
            if self.proc is not None and self.proc.poll() is not None:
                raise SiteFailed(f"fiberd exited while warming: {self.last_log_line()}")
            templates = self.request("status").get("templates")
            state = str(templates.get(GRANT, "no grant yet")) if isinstance(
                templates, dict) else "no grant yet"
            if state == "ready":
                return elapsed
            if state == "warm_failed":
                raise SiteFailed(f"the template failed to warm: {self.warm_error()}")
            if elapsed > within:
                raise SiteFailed(f"the template did not warm within {within:g} s ({state})")
            progress(state, elapsed)
            time.sleep(0.1)

    def warm_error(self) -> str:
        """The template's warm error (``Error: message``) as the grant listing reports it."""
        grants = self.request("list_grants").get("grants")
        for grant in grants if isinstance(grants, list) else []:
            template = grant.get("template") if isinstance(grant, dict) else None
            error = template.get("warm_error") if isinstance(template, dict) else None
            if isinstance(error, dict):
                return f"{error.get('error')}: {error.get('message')}"
        return "unknown error"

    def stop(self, within: float = 30.0) -> int | None:
        """SIGTERM fiberd and wait for it (SIGKILL after ``within`` s); its exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(within)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def leftovers(self) -> list[int]:
        """Pids of live processes of this run (templates, fibers) found by walking /proc."""
        return marked(self.run_id, RUN_MARK)

    def last_log_line(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return lines[-1] if lines else f"no output (log {self.log_path})"
