"""The epilog's clean-up of Slurm's cgroup/v2 tree, on a real cgroup2 tree in Slurm's layout.

The test builds <mount>/system.slice/n1_slurmstepd.scope/<job>/step_0/{slurm,user/task_0}
below a cgroup of its own in the host's cgroup2, with what a job's fiberd carves below
task_0 holding a real process (and one escaped with setsid), and a stand-in for Slurm's
slurmstepd in step_0/slurm.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.common import populated
from slurm_fiber.epilog.cgroup_v2 import clear, job_dir
from slurm_fiber.homes.slurm.jobenv import SlurmJob

CGROUP2 = Path("/sys/fs/cgroup/unified")
SCOPE = "system.slice/n1_slurmstepd.scope"


def job(job_id: int = 42, sluid: str | None = None) -> SlurmJob:
    return SlurmJob(job_id=job_id, uid=2001, gid=2001, user="sfalice", partition="debug",
                    node="n1", cluster="c", sluid=sluid)


@pytest.fixture
def mount() -> Iterator[Path]:
    """A cgroup2 subtree standing in for a node's cgroup2 mount; all of it gone afterwards."""
    if not os.access(CGROUP2 / "cgroup.procs", os.W_OK):
        pytest.skip(f"no writable cgroup v2 at {CGROUP2}")
    root = CGROUP2 / f"sf-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    (root / "cgroup.kill").write_text("1\n")
    for dirpath in sorted((d for d, _, _ in os.walk(root)), key=lambda d: -len(d)):
        for _ in range(100):
            try:
                os.rmdir(dirpath)
                break
            except OSError:
                populated(Path(dirpath))


def start_in(group: Path, *argv: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(list(argv) or ["sleep", "300"], env={})
    (group / "cgroup.procs").write_text(f"{proc.pid}\n")
    return proc


def test_what_a_fiberd_carved_below_its_task_is_killed_and_removed(mount: Path) -> None:
    jobdir = mount / SCOPE / "s7B1M90RT51P00"  # 26.05 names it by the job's SLUID
    task = jobdir / "step_0" / "user" / "task_0"
    slot = task / "grant-g1" / "fibers" / "group-0" / "slot-1"
    slot.mkdir(parents=True)
    (task / "fiberd").mkdir()
    (jobdir / "step_0" / "slurm").mkdir()
    fiber = start_in(slot)
    escaped = start_in(slot, "setsid", "sleep", "301")
    fiberd = start_in(task / "fiberd")
    assert job_dir(mount, job(sluid="s7B1M90RT51P00")) == jobdir
    assert job_dir(mount, job()) is None  # job_42 is not there
    removed, left = clear(mount, job(sluid="s7B1M90RT51P00"), wait_s=5.0)
    assert fiber.wait(5) == -9 and escaped.wait(5) == -9 and fiberd.wait(5) == -9
    assert left == [] and removed == 10 and not jobdir.exists()
    assert (mount / SCOPE).is_dir()  # the scope is Slurm's, never touched


def test_slurms_own_processes_are_never_killed(mount: Path) -> None:
    """Only what runs below a task cgroup is the job's: a process in step_0/slurm (where
    Slurm's slurmstepd lives) is left alone, and the directories it keeps busy are named."""
    jobdir = mount / SCOPE / "job_42"
    (jobdir / "step_0" / "user" / "task_0" / "grant-g1").mkdir(parents=True)
    (jobdir / "step_0" / "slurm").mkdir()
    stepd = start_in(jobdir / "step_0" / "slurm")
    try:
        removed, left = clear(mount, job(), wait_s=1.0)
        assert stepd.poll() is None and removed == 3  # grant-g1, task_0, user
        assert not (jobdir / "step_0" / "user").exists()
        assert left and all("Device or resource busy" in line for line in left), left
        assert str(jobdir / "step_0" / "slurm") in left[0]
    finally:
        stepd.kill()
        stepd.wait()


def test_a_job_dir_not_roots_is_not_touched(mount: Path) -> None:
    """Every name on the way must be root's: a job dir chowned to someone else is skipped."""
    jobdir = mount / SCOPE / "job_42"
    (jobdir / "step_0").mkdir(parents=True)
    os.chown(jobdir, 2001, 2001)
    assert job_dir(mount, job()) is None
    assert clear(mount, job(), wait_s=0.1) == (0, [])
    assert jobdir.is_dir()
