"""The `slurm_cluster` fixture: the bare-host 2-node Slurm cluster, running or brought up here.

It uses a cluster that is already up (read through `bare-host status --json`
and `bare-host env`), or, as root on Debian, runs `bare-host up` (with the
slurm_fiber prolog and epilog wired in) and `down` at the end of the
session. When neither works it skips with the reason (CI turns that skip
into a failure, as intended). `test_user` is a non-root account for jobs
whose ownership matters (created with useradd when absent).
"""

from __future__ import annotations

import os
import pwd
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

BARE_HOST = Path(__file__).resolve().parents[2] / "docker" / "slurm-cluster" / "bare-host"
FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                      "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


def bare_host(*args: str, env: dict[str, str] | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run docker/slurm-cluster/bare-host with ``args``; never raises on a non-zero exit."""
    return subprocess.run([str(BARE_HOST), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def exports(text: str) -> dict[str, str]:
    """The variables of `bare-host env` output ("export K=V" lines, V maybe single-quoted)."""
    pairs = (line.removeprefix("export ").split("=", 1) for line in text.splitlines()
             if line.startswith("export "))
    return {k: v.strip("'") for k, v in pairs}


@dataclass(frozen=True)
class SlurmCluster:
    """A running cluster: ``env`` for client commands, its run dir and node names.

    ``site_config`` is the slurm_fiber site config its prolog and epilog use
    (None when it was brought up with --no-hooks).
    """

    env: dict[str, str]
    run_dir: Path
    nodes: tuple[str, ...]
    site_config: Path | None = None

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command with the cluster's SLURM_CONF; blocks until it exits."""
        return subprocess.run(list(argv), capture_output=True, text=True, env=self.env,
                              timeout=timeout)

    def srun(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.run("srun", *args, timeout=timeout)

    def submit(self, script: str, *sbatch_args: str, workdir: Path) -> int:
        """sbatch ``script`` (text) from ``workdir``; returns the job id or fails the test."""
        path = workdir / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        out = self.run("sbatch", "--parsable", f"--chdir={workdir}",
                       f"--output={workdir}/slurm-%j.out", *sbatch_args, str(path))
        assert out.returncode == 0, f"sbatch failed: {out.stderr.strip()}"
        return int(out.stdout.strip().split(";")[0])

    def state(self, job_id: int) -> str:
        """squeue's %T for the job, "" once it has left the queue."""
        return self.run("squeue", "-h", "-j", str(job_id), "-o", "%T").stdout.strip()

    def wait_for(self, job_id: int, states: frozenset[str] | set[str],
                 timeout: float = 60) -> str:
        """Poll squeue every 0.1 s until the job's state is in ``states`` (or it is gone when
        ``states`` contains ""); fails the test at ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        state = self.state(job_id)
        while state not in states:
            assert time.monotonic() < deadline, f"job {job_id} still {state!r} after {timeout} s"
            time.sleep(0.1)
            state = self.state(job_id)
        return state

    def wait_done(self, job_id: int, timeout: float = 60) -> str:
        return self.wait_for(job_id, FINISHED | {""}, timeout)


def private_cluster_env(tmp_path: Path) -> dict[str, str]:
    """The environment for `bare-host` to run a second, private cluster under ``tmp_path``.

    Makes ``tmp_path`` and its parents traversable by all, as munged requires
    of its socket's directories. Needs root (callers skip otherwise).
    """
    tmp_path.chmod(0o755)
    for parent in tmp_path.parents:
        if parent.stat().st_mode & 0o011 != 0o011:
            parent.chmod(parent.stat().st_mode | 0o011)
    return os.environ | {"SLURM_FIBER_CLUSTER_DIR": str(tmp_path / "cluster")}


@dataclass(frozen=True)
class BareHost:
    """What tests of the bare-host script itself need."""

    path: Path = BARE_HOST
    run = staticmethod(bare_host)
    exports = staticmethod(exports)
    private_env = staticmethod(private_cluster_env)


@pytest.fixture(scope="session")
def bare_host_script() -> BareHost:
    """The bare-host script, its runner and its `env` parser (tests cannot import conftest)."""
    return BareHost()


def _can_bring_up() -> str | None:
    """Why this machine cannot run `bare-host up`, or None when it can."""
    if os.geteuid() != 0:
        return "not root"
    if not Path("/etc/debian_version").exists():
        return "not Debian"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    started_here = False
    if bare_host("status", "--json").returncode != 0:
        reason = _can_bring_up()
        if reason:
            pytest.skip(f"no Slurm cluster up and cannot start one: {reason}")
        up = bare_host("up", timeout=600)
        if up.returncode != 0:
            pytest.skip(f"bare-host up failed: {up.stderr.strip()[-2000:]}")
        started_here = True
    variables = exports(bare_host("env").stdout)
    cluster = SlurmCluster(
        env=os.environ | variables,
        run_dir=Path(variables["SLURM_FIBER_CLUSTER_DIR"]),
        nodes=tuple(variables["SLURM_FIBER_CLUSTER_NODES"].split()),
        site_config=Path(variables["SLURM_FIBER_CONFIG"]) if "SLURM_FIBER_CONFIG" in variables
        else None,
    )
    yield cluster
    if started_here:
        bare_host("down")


TEST_USER = "sfjob"


@dataclass(frozen=True)
class JobUser:
    """A non-root account jobs can run as: name, uid, gid."""

    name: str
    uid: int
    gid: int


@pytest.fixture(scope="session")
def test_user() -> JobUser:
    """The non-root job user (useradd once, idempotent); skips when not root."""
    if os.geteuid() != 0:
        pytest.skip("creating the job test user needs root")
    try:
        entry = pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh",
                        TEST_USER], capture_output=True)  # a parallel run may win the race
        entry = pwd.getpwnam(TEST_USER)
    return JobUser(entry.pw_name, entry.pw_uid, entry.pw_gid)
