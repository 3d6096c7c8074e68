"""A hostile job user against the epilog through the job's own state dir.

``mallory`` owns her job's state dir, so she can put anything at ``fiberd.json``: a
FIFO, a symlink to one, a huge file. The epilog (the real console script, run as
slurmd runs it) must still finish within its bound and kill every process carrying
the job's environment. A process of hers, started with the job's variables, is the
proof: it must be gone afterwards.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from slurm_fiber.homes.slurm.paths import job_paths
from tests.hooks.hookkit import ISSUER, Site, gone, job_env, run_hook
from tests.security.publicdirkit import public_dir
from tests.security.userkit import JobUser

BOUND_S = 30  # far above the epilog's steps (2 s each): reaching it means a stall


@pytest.fixture
def site() -> Iterator[Site]:
    with public_dir() as scratch:
        yield Site(scratch / "site")


@pytest.fixture
def leftover(mallory: JobUser) -> Iterator[subprocess.Popen[bytes]]:
    """A process of mallory's job 21 that outlived the job (its environment names it)."""
    env = mallory.spawn_args()["env"] | {"SLURM_JOB_ID": "21", "SLURMD_NODENAME": "n1",
                                         "SLURM_CLUSTER_NAME": ISSUER}
    proc = subprocess.Popen(["sleep", "300"], **(mallory.spawn_args() | {"env": env}))
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


PLANTS = {
    "fifo": "mkfifo fiberd.json",
    "symlink_to_a_fifo": "mkfifo pipe && ln -s \"$PWD/pipe\" fiberd.json",
    "huge_file": "head -c 50000000 /dev/zero > fiberd.json",
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_record_never_stalls_the_epilog_or_spares_a_process(
        site: Site, mallory: JobUser, leftover: subprocess.Popen[bytes], plant: str) -> None:
    env = job_env(site, 21, mallory.uid, mallory.gid, mallory.name)
    assert run_hook("prolog", env).returncode == 0
    state_dir = job_paths(site.state_root, "n1", 21).state_dir
    planted = subprocess.run(["/bin/sh", "-c", f"cd '{state_dir}' && {PLANTS[plant]}"],
                             capture_output=True, text=True, timeout=BOUND_S,
                             **mallory.spawn_args())
    assert planted.returncode == 0, planted.stderr
    out = run_hook("epilog", env | {"SLURM_SCRIPT_CONTEXT": "epilog_slurmd"}, timeout=BOUND_S)
    assert "did not finish" not in out.stderr, out.stderr
    assert out.returncode == 0, out.stderr
    assert leftover.wait(timeout=BOUND_S) is not None and gone(leftover.pid)
    assert "fiberd record ignored" in out.stderr and "killed 1 leftover process" in out.stderr
    assert all(line.startswith("slurm-fiber-epilog: job 21: ")
               for line in out.stderr.splitlines()), out.stderr
    assert not state_dir.exists()
