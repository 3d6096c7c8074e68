"""The Slurm home's stage: a real batch job on a real cluster, fiberd given its step's environment.

``open`` submits a batch job holding one GPU (``--gres=gpu:1``) whose one step,
``srun --overlap -n1 env -0``, captures what ``srun --overlap fiberd-run`` would
see, then sleeps. The cluster is whatever ``SLURM_CONF`` names, with the site
config ``SLURM_FIBER_CONFIG`` its prolog uses. fiberd runs in this process with
that environment and ``--home slurm``, configured as fiberd-run is, but trusting
only the harness's issuer (the prolog's own grant is refused).

- fiberd runs as the job's user, so the whole harness does: the stage refuses to
  open as root, and ``slurm-fiber conform --home slurm`` started as root runs itself
  again as ``$SLURM_FIBER_CONFORM_USER`` (default ``nobody``) with a plain
  environment, from "/" (``rerun_as_job_user``). The step environment the job
  writes is read through safefs (no link followed, no FIFO waited on, bounded).
- fiberd's own state is kept in the stage dir, not the job's (this fiberd outlives
  the job's end); grants, readiness, the fiberd record and the GPU leases are the
  job's, where the prolog and epilog look.
- fiberd runs uncarved: while the stage is open the prolog's delegated-cgroup
  record is held aside (put back before the job is cancelled), so ``scope.loss``
  tests the home's poll, not the epilog.

Levers:

- deliver / remove: write ``<uid>.jwt`` in the job's grantdir by rename, owned by
  the job's user, or delete it;
- silence / restore: fiberd's ``SLURM_CONF`` is a symlink in the stage dir, swapped
  between the cluster's slurm.conf and a copy whose ``SlurmctldPort`` is bound but
  not listening, so only this fiberd's calls are refused;
- lose_scope: ``scancel`` the job, after withdrawing fiberd's record (the epilog
  would otherwise SIGKILL the harness);
- readiness: the job's ready file, sampled (the job Comment is not read);
- devices / held_devices: the job's GPU(s) on its node, and those fiberd's Slurm
  home holds for a grant now and whose node lease the job holds.

The Slurm home polls slurmctld every 5 s (``SlurmHomeConfig.poll_every``), so the
stale TTL is set above that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from slurm_fiber import safefs
from slurm_fiber.config import FiberdConfig, load_config
from slurm_fiber.conform.stage import (
    Capability,
    Issuer,
    Launch,
    OpenedStage,
    Published,
    StageCannot,
    while_open,
)
from slurm_fiber.core.clock import Clock, SystemClock
from slurm_fiber.core.devices import Device
from slurm_fiber.homes.problem import ProblemSink
from slurm_fiber.homes.select import BuiltHome, build_home, home_defaults
from slurm_fiber.homes.slurm import fiberdrecord
from slurm_fiber.homes.slurm.home import SlurmHome
from slurm_fiber.homes.slurm.jobenv import SlurmJob, job_from_env
from slurm_fiber.homes.slurm.leases import job_party, node_leases
from slurm_fiber.homes.slurm.paths import JobPaths, gpu_resource, job_paths
from slurm_fiber.homes.slurm.siteconfig import home_config, load_site_config

POLL_INTERVAL = 0.05  # seconds between grantdir polls
STALE_TTL = 7.0  # above the home's 5 s slurmctld poll, so a live cluster never reads stale
FENCE_TTL = 14.0
SAMPLE_EVERY = 0.01  # seconds between looks at the ready file
START_TIMEOUT = 60.0  # seconds for the job to start and its step to report its environment
COMMAND_TIMEOUT = 30.0
JOB_SCRIPT = """#!/bin/sh
srun --overlap -n1 env -0 > step.env.tmp && mv step.env.tmp step.env
exec sleep 1800
"""
JOB_USER_ENV = "SLURM_FIBER_CONFORM_USER"
DEFAULT_JOB_USER = "nobody"
SITE_VENV_ENV = "SLURM_FIBER_SITE_VENV"
JOB_PATH = "/usr/local/bin:/usr/bin:/bin"
RUNUSER = "/usr/sbin/runuser"
STOP_GRACE = 15.0  # seconds an interrupted rerun may take to close its stage
MAX_STEP_ENV = 1 << 20  # bytes of the step environment the stage reads
CTLD_PORT = re.compile(r"^\s*SlurmctldPort\s*=.*$", re.IGNORECASE | re.MULTILINE)


def dead_conf(conf: str, port: int) -> str:
    """``conf`` (slurm.conf text) with slurmctld moved to ``port`` on the same host. Pure."""
    line = f"SlurmctldPort={port}"
    if CTLD_PORT.search(conf):
        return CTLD_PORT.sub(line, conf)
    return f"{conf.rstrip()}\n{line}\n"


def parse_env0(data: bytes) -> dict[str, str]:
    """``env -0`` output as a mapping (entries without ``=`` skipped). Pure."""
    pairs = (item.decode(errors="replace").partition("=") for item in data.split(b"\0") if item)
    return {key: value for key, sep, value in pairs if sep}


def job_user(environ: Mapping[str, str], euid: int) -> pwd.struct_passwd | None:
    """The account the harness, its fiberd and its job run as: None (this process's own)
    unless ``euid`` is root, then ``$SLURM_FIBER_CONFORM_USER`` or ``nobody``. Raises
    StageCannot for an account that does not exist, or for root itself."""
    if euid != 0:
        return None
    name = environ.get(JOB_USER_ENV) or DEFAULT_JOB_USER
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise StageCannot(f"{JOB_USER_ENV}={name}: no such account") from None
    if entry.pw_uid == 0:
        raise StageCannot(f"{JOB_USER_ENV}={name} is root: jobs run as a job user")
    return entry


def job_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the job user's run gets: a plain PATH and locale and the SLURM_* variables. Pure."""
    return {"PATH": JOB_PATH, "LANG": "C.UTF-8",
            **{k: v for k, v in environ.items() if k.startswith("SLURM_")}}


def read_job_file(path: Path, max_bytes: int) -> bytes:
    """A file the job wrote in a dir of this process's user: safefs.read_file (a regular file
    of one link, this user's, at most ``max_bytes``; no link followed, no FIFO waited on) in
    the dir safefs.open_dir opened. OSError (UnsafePath) otherwise."""
    dir_fd = safefs.open_dir(path.parent, trusted_owners=(os.geteuid(),))
    try:
        return safefs.read_file(dir_fd, path.name, max_bytes=max_bytes, owners=(os.geteuid(),))
    finally:
        os.close(dir_fd)


def rerun_bound(clauses: int, settle_margin: float) -> float:
    """Seconds a rerun of ``clauses`` clauses may take: the runner's budget per clause for
    this stage's options, plus the job's start and its cancellation. Pure."""
    settle = settle_margin + 5 * POLL_INTERVAL + 0.5
    return START_TIMEOUT + 2 * COMMAND_TIMEOUT + clauses * (4 * settle + STALE_TTL + 30.0)


def rerun_as_job_user(args: Sequence[str], environ: Mapping[str, str], within: float) -> int:
    """Run ``slurm-fiber <args>`` again as the stage's job user; its exit code.

    For ``slurm-fiber conform --home slurm`` started as root (see the module
    doc): ``runuser -u <user> --`` the site install's ``slurm-fiber`` with
    ``job_env``, from "/", in a session of its own; its output is this
    command's. Blocks up to ``within`` seconds; then (or on
    KeyboardInterrupt, re-raised) it is interrupted (SIGINT to its process
    group: the stage closes and cancels its job), and SIGKILLed STOP_GRACE
    seconds later. Raises StageCannot for an unusable account.
    """
    user = job_user(environ, 0)
    assert user is not None  # job_user gives an account for root, or raises
    venv = environ.get(SITE_VENV_ENV)
    program = (Path(venv) / "bin" if venv else Path(sys.executable).parent) / "slurm-fiber"
    proc = subprocess.Popen([RUNUSER, "-u", user.pw_name, "--", str(program), *args],
                            env=job_env(environ), cwd="/", start_new_session=True)
    try:
        return proc.wait(within)
    except subprocess.TimeoutExpired:
        print(f"slurm-fiber conform: the run as {user.pw_name} did not end within "
              f"{within:g} s; interrupted", file=sys.stderr)
        _interrupt(proc)
        return 1
    except KeyboardInterrupt:
        _interrupt(proc)
        raise


def _interrupt(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT ``proc``'s process group, SIGKILL it after STOP_GRACE s; wait for ``proc``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _run(*argv: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command (a Slurm client) with ``env`` (default: this process's); bounded, never
    raises."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                              check=False, env=env)
    except (OSError, subprocess.TimeoutExpired) as err:
        return subprocess.CompletedProcess(argv, 1, "", str(err))


def _swap_link(link: Path, target: Path) -> None:
    """Point ``link`` at ``target`` atomically (a new symlink renamed over it)."""
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    tmp.rename(link)


class SlurmStage(OpenedStage):
    """Drives ``fiberd --home slurm`` inside one real batch job. Open it once; one event loop."""

    home = "slurm"
    lacks: Mapping[Capability, str] = {}

    def __init__(self) -> None:
        super().__init__()
        self._job_id: int | None = None
        self._environ: dict[str, str] = {}
        self._job: SlurmJob | None = None
        self._paths: JobPaths | None = None
        self._devices: tuple[Device, ...] = ()
        self._refuser: socket.socket | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._last_doc: object = None
        self._history: list[bool] = []
        self._home: SlurmHome | None = None

    @property
    def job(self) -> SlurmJob:
        return while_open(self._job)

    @property
    def paths(self) -> JobPaths:
        return while_open(self._paths)

    # ---- open / close

    async def open(self, workdir: Path, issuer: Issuer) -> None:
        """Submit the job, wait for its step's environment, prepare the two slurm.confs.

        Blocks (in threads) up to START_TIMEOUT for the job to start. Raises
        StageCannot (one line) when there is no usable cluster, or when run as
        root (fiberd runs as the job user: see ``rerun_as_job_user``).
        """
        if os.geteuid() == 0:
            raise StageCannot("fiberd runs as the job's user, not root: run the harness as "
                              f"the job user (`slurm-fiber conform` started as root re-runs "
                              f"itself as ${JOB_USER_ENV}, default {DEFAULT_JOB_USER})")
        self.opened(workdir, issuer)
        (workdir / "fiberd").mkdir(mode=0o700)
        conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
        try:
            text = conf.read_text()
        except OSError as err:
            raise StageCannot(f"no Slurm cluster configuration at {conf}: {err.strerror} "
                              "(set SLURM_CONF, e.g. eval \"$(bare-host env)\")") from None
        self._refuser = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._refuser.bind(("127.0.0.1", 0))  # bound, never listening: connections refused
        (workdir / "dead.conf").write_text(dead_conf(text, self._refuser.getsockname()[1]))
        (workdir / "slurm.conf").symlink_to(conf.resolve())
        try:
            await self._open_job(workdir)
        except BaseException:
            await self.close()  # the runner closes only a stage that opened: no job left
            raise

    async def _open_job(self, workdir: Path) -> None:
        """Submit the job and learn it, its paths and its devices from its step's environment."""
        step_env = await asyncio.to_thread(self._start_job, workdir)
        self._environ = {**step_env, "SLURM_CONF": str(workdir / "slurm.conf")}
        if os.environ.get("SLURM_FIBER_CONFIG"):
            self._environ["SLURM_FIBER_CONFIG"] = os.environ["SLURM_FIBER_CONFIG"]
        try:
            self._job = job_from_env(self._environ)
            site = load_site_config(self._environ)
            gpu_files = home_config(site, self._job.node).gpu_files
        except ValueError as err:  # SlurmParseError, SiteConfigError
            raise StageCannot(f"job {self._job_id}: {err}") from None
        self._paths = job_paths(site.state_root, self._job.node, self._job.job_id)
        visible = dict(zip(self._job.gpus, self._job.gpu_visible, strict=False))
        self._devices = tuple(Device("gpu", i, path=gpu_files.get(i), visible=visible.get(i))
                              for i in self._job.gpus)
        if not self.paths.grantdir.is_dir():
            raise StageCannot(f"job {self._job_id}: no grantdir {self.paths.grantdir}: "
                              "is the slurm_fiber prolog configured?")
        if self.paths.cgroup_file.exists():
            self.paths.cgroup_file.rename(self._held_record)
        self._sampler = asyncio.ensure_future(self._sample_forever())

    @property
    def _held_record(self) -> Path:
        return self.root / "cgroup.record"

    def _end_job(self) -> subprocess.CompletedProcess[str]:
        """Put the delegated-cgroup record back for the epilog, then ``scancel`` the job."""
        if self._paths is not None and self._held_record.exists():
            with contextlib.suppress(OSError):
                self._held_record.rename(self._paths.cgroup_file)
        return _run("scancel", str(self._job_id))

    def _start_job(self, jobdir: Path) -> dict[str, str]:
        """Submit the job (as this process's user) to run in ``jobdir``; its step's
        environment once it reported it."""
        script = jobdir / "job.sh"
        script.write_text(JOB_SCRIPT)
        script.chmod(0o644)
        out = _run("sbatch", "--parsable", "--gres=gpu:1", "--time=30", "-n1",
                   "--job-name=slurm-fiber-conform", f"--chdir={jobdir}",
                   f"--output={jobdir}/job.out", str(script))
        if out.returncode != 0:
            raise StageCannot(f"sbatch failed: {out.stderr.strip()[:300]}")
        self._job_id = int(out.stdout.strip().split(";")[0])
        env_file, deadline = jobdir / "step.env", time.monotonic() + START_TIMEOUT
        while not env_file.exists():
            state = _run("squeue", "-h", "-j", str(self._job_id), "-o", "%T").stdout.strip()
            if state not in ("PENDING", "CONFIGURING", "RUNNING"):
                raise StageCannot(f"job {self._job_id} is {state or 'gone'} before its step "
                                  f"ran: {self._job_out()}")
            if time.monotonic() > deadline:
                raise StageCannot(f"job {self._job_id} still {state} after {START_TIMEOUT:g} s")
            time.sleep(0.1)
        try:
            return parse_env0(read_job_file(env_file, MAX_STEP_ENV))
        except OSError as err:
            raise StageCannot(f"job {self._job_id}: its step environment: {err}") from None

    def _job_out(self) -> str:
        with contextlib.suppress(OSError):
            out = read_job_file(self.root / "job.out", MAX_STEP_ENV)
            return out.decode(errors="replace")[-300:].strip() or "no output"
        return "no output"

    async def close(self) -> None:
        """Stop sampling, cancel the job (if still there), free the port. Never raises."""
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(BaseException):
                await self._sampler
            self._sampler = None
        if self._job_id is not None:
            await asyncio.to_thread(self._end_job)
            self._job_id = None
        if self._refuser is not None:
            self._refuser.close()
            self._refuser = None

    # ---- fiberd

    def launch(self) -> Launch:
        """fiberd as fiberd-run starts it in the job, but trusting only the harness's issuer
        and keeping its own state (book, audit, socket, logs) in the stage dir."""
        defaults = {k: v for k, v in home_defaults("slurm", self._environ).items()
                    if k != "trust"}
        flags = {
            "home": "slurm", "state_dir": str(self.root / "fiberd"),
            "trust": self.trust,
            "poll_interval": str(POLL_INTERVAL), "stale_ttl": str(STALE_TTL),
            "fence_ttl": str(FENCE_TTL), "grace": "0.5", "audit_fsync": "never",
        }
        return Launch(load_config(env={}, flags=flags, home_defaults=defaults), self._environ,
                      build=self._build)

    async def _build(self, config: FiberdConfig, clock: Clock, environ: Mapping[str, str],
                     on_problem: ProblemSink) -> BuiltHome:
        """The Slurm home exactly as ``fiberd`` builds it, kept to read what it holds."""
        built = await build_home(config, clock, environ, on_problem)
        assert isinstance(built.home, SlurmHome)
        self._home = built.home
        return built

    # ---- levers

    async def deliver(self, uid: str, token: str) -> None:
        """Write ``<uid>.jwt`` (0600, the job user's) into the job's grantdir by rename."""
        safefs.replace_file(self.paths.grantdir / f"{uid}.jwt", token.encode(), mode=0o600,
                           uid=self.job.uid, gid=self.job.gid)

    async def remove(self, uid: str) -> None:
        """Delete ``<uid>.jwt``."""
        (self.paths.grantdir / f"{uid}.jwt").unlink(missing_ok=True)

    async def silence(self) -> None:
        """Point fiberd's SLURM_CONF at the dead controller: its Slurm calls are refused."""
        _swap_link(self.root / "slurm.conf", self.root / "dead.conf")

    async def restore(self) -> None:
        """Point fiberd's SLURM_CONF at the cluster's slurm.conf again."""
        real = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).resolve()
        _swap_link(self.root / "slurm.conf", real)

    async def lose_scope(self) -> None:
        """Withdraw fiberd's record (it is this process), then ``scancel`` the job."""
        fiberdrecord.remove_record(self.paths.state_dir)
        out = await asyncio.to_thread(self._end_job)
        if out.returncode != 0:
            raise StageCannot(f"scancel {self.job.job_id} failed: {out.stderr.strip()[:200]}")

    def readiness(self) -> Published:
        """The ready file's state now, and every distinct publish sampled since ``open``."""
        current = self._sample()
        return Published(current, tuple(self._history))

    def devices(self) -> tuple[Device, ...]:
        """The job's GPU(s) on its node, as the home names them."""
        return self._devices

    def held_devices(self) -> frozenset[Device]:
        """The job's GPUs that fiberd's home holds for a grant now and whose node lease the
        job's party holds (the prolog's claim, root's: it lasts the whole job)."""
        if self._home is None:
            return frozenset()
        party = job_party(self.job)
        leases = node_leases(self.paths, SystemClock(), ttl=60.0)
        leased = {h.env for h in leases.dir.list() if h.party().same_as(party)}
        held = self._home.held_resources() & leased
        return frozenset(d for d in self._devices
                         if gpu_resource(self.job.node, d.index) in held)

    # ---- readiness sampling

    def _sample(self) -> bool | None:
        """Read the ready file; a document not seen before adds its state to the history."""
        try:
            doc = json.loads(self.paths.ready_file.read_text())
            ready = doc["ready"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(ready, bool):
            return None
        if doc != self._last_doc:
            self._last_doc = doc
            self._history.append(ready)
        return ready

    async def _sample_forever(self) -> None:
        while True:
            self._sample()
            await asyncio.sleep(SAMPLE_EVERY)
