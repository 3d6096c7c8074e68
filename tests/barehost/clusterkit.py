"""The bare-host 2-node Slurm cluster as tests see it: its script, a running cluster's
client commands, job users' work dirs. The fixtures over it (``slurm_cluster``,
``bare_host_script``, ``job_user``, ``other_user``, ``test_user``, ``job_dir``,
``private_dir``) are in tests/conftest.py, for every dir with cluster tests.

``slurm_cluster`` uses a cluster that is already up (read through `bare-host status --json`
and `bare-host env`; as root, `bare-host up` first refreshes its site venv
from the checkout's current sources), or, as root on Debian, runs `bare-host up` (with the
slurm_fiber prolog and epilog wired in) and `down` at the end of the
session. When neither works it skips with the reason (CI turns that skip
into a failure, as intended).

Jobs run as unprivileged users, as on a site: ``SlurmCluster.submit`` and
``srun`` take the ``user`` to submit as (``runuser -u <user> -- sbatch``, which
works on every Slurm release, unlike sbatch's removed ``--uid``), with a plain
environment (no root HOME, venv or PYTHONPATH). ``job_user`` (sfalice) and
``other_user`` (sfmallory) are the two accounts of tests/security/userkit.py,
``test_user`` (sfjob) the one the hook tests use; ``job_dir`` gives a job user
a work dir of its own (0700), outside pytest's root-only tmp_path. A job that
must still run as root passes ``user=None`` and says why at the call.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.security.userkit import JobUser

BARE_HOST = Path(__file__).resolve().parents[2] / "docker" / "slurm-cluster" / "bare-host"
JOB_PATH = "/usr/local/bin:/usr/bin:/bin"
RUNUSER = shutil.which("runuser", path="/usr/sbin:/sbin:/usr/bin:/bin") or "runuser"
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

    ``site_config`` is the slurm_fiber site config its prolog and epilog use and
    ``site_venv`` the site install jobs run (both None when it was brought up
    with --no-hooks).
    """

    env: dict[str, str]
    run_dir: Path
    nodes: tuple[str, ...]
    site_config: Path | None = None
    site_venv: Path | None = None

    @property
    def site_bin(self) -> Path:
        """The site venv's bin dir (fiberd-run, fiberctl); fails the test without hooks."""
        assert self.site_venv is not None, "the cluster is up without hooks: bare-host down"
        return self.site_venv / "bin"

    def job_env(self) -> dict[str, str]:
        """What a job user's command gets: a plain PATH and locale, and of ``env`` only the
        cluster's and fiberd's variables (SLURM_*, FIBERD_*), nothing of root's."""
        mine = {k: v for k, v in self.env.items() if k.startswith(("SLURM_", "FIBERD_"))}
        return {"PATH": JOB_PATH, "LANG": "C.UTF-8", **mine}

    def run(self, *argv: str, user: JobUser | None = None, timeout: float = 60,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command (a Slurm client, fiberctl) with the cluster's SLURM_CONF and
        ``extra_env``, as root or (``user``) as that account through ``runuser`` with
        ``job_env``; blocks until it exits."""
        if user is None:
            return subprocess.run(list(argv), capture_output=True, text=True,
                                  env=self.env | (extra_env or {}), timeout=timeout)
        return subprocess.run([RUNUSER, "-u", user.name, "--", *argv], capture_output=True,
                              text=True, env=self.job_env() | (extra_env or {}), cwd="/",
                              timeout=timeout)

    def srun(self, *args: str, user: JobUser | None,
             timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.run("srun", *args, user=user, timeout=timeout)

    def submit(self, script: str, *sbatch_args: str, workdir: Path,
               user: JobUser | None) -> int:
        """sbatch ``script`` (text) from ``workdir`` as ``user`` (None: root); returns the job
        id or fails the test."""
        path = workdir / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        path.chmod(0o644)
        out = self.run("sbatch", "--parsable", f"--chdir={workdir}",
                       f"--output={workdir}/slurm-%j.out", *sbatch_args, str(path), user=user)
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


def new_job_dir(path: Path, user: JobUser) -> Path:
    """Make ``path`` (a new dir) ``user``'s, mode 0700; returns it."""
    path.mkdir(mode=0o700)
    os.chown(path, user.uid, user.gid)
    return path
