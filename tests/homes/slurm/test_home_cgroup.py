"""The Slurm home's cgroup root choice, on a cgroup tree and a /proc the test builds.

(Slurm's layout is built as directories with cgroup.procs files; the real trees of
22.05, 24.11 and 26.05 are in test_releases.py and tests/containers.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.v2 import cgroup2_mount
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes.slurm.cgroup_root import (
    LEAF,
    choose_cgroup_root,
    delegated_root,
)
from slurm_fiber.homes.slurm.control import CliControl
from slurm_fiber.homes.slurm.home import SlurmHomeConfig, build_slurm_home
from slurm_fiber.homes.slurm.paths import job_paths
from tests.homes.slurm.replaykit import env_file

PID = 4321
SCOPE = "system.slice/slurmstepd.scope"


class Tree:
    """A cgroup2 mount and a /proc with one process, ``PID``, placed where the test says."""

    def __init__(self, root: Path) -> None:
        self.mount = root / "cgroup"
        self.proc = root / "proc"
        self.record = root / "state" / "cgroup"
        self.record.parent.mkdir(parents=True)

    def cgroup(self, relative: str, procs: str = "") -> Path:
        path = self.mount / relative
        path.mkdir(parents=True, exist_ok=True)
        for above in [path, *path.parents][:len(path.parts) - len(self.mount.parts) + 1]:
            (above / "cgroup.procs").touch()  # every cgroup has one, as cgroupfs shows it
        (path / "cgroup.procs").write_text(procs)
        return path

    def place(self, relative: str, others: str = "") -> Path:
        """Put PID in cgroup ``relative`` (with ``others`` beside it) and return the cgroup."""
        path = self.cgroup(relative, f"{PID}\n{others}")
        (self.proc / str(PID)).mkdir(parents=True, exist_ok=True)
        (self.proc / str(PID) / "cgroup").write_text(f"0::/{relative}\n")
        (self.proc / "self").mkdir(exist_ok=True)
        (self.proc / "self" / "mountinfo").write_text(
            f"36 25 0:30 / {self.mount} rw,nosuid shared:10 - cgroup2 cgroup2 rw\n")
        return path

    def choose(self, job_id: int = 42, sluid: str | None = None):
        return choose_cgroup_root(self.record, self.mount, job_id, PID, self.proc, sluid)


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    return Tree(tmp_path)


def test_own_task_cgroup_is_carved_after_moving_into_a_leaf(tree: Tree) -> None:
    task = tree.place(f"{SCOPE}/job_42/step_0/user/task_0")
    (task / "cgroup.procs").write_text("")  # as the kernel shows it once PID moved out
    choice = tree.choose()
    assert choice.path == task
    assert choice.reason == "own cgroup (job_42, step 0)"
    assert (task / LEAF / "cgroup.procs").read_text() == f"{PID}\n"


def test_own_cgroup_shared_with_another_process_is_not_carved(tree: Tree) -> None:
    tree.place(f"{SCOPE}/job_42/step_0/user/task_0", others="999\n")
    choice = tree.choose()
    assert choice.path is None and "shared with other processes (999)" in choice.reason


@pytest.mark.parametrize(("where", "reason"), [
    (f"{SCOPE}/job_7/step_0/user/task_0", "belongs to job 7, not 42"),
    (f"{SCOPE}/job_42", "is the job's cgroup, which Slurm manages"),
    (f"{SCOPE}/s5K1KKYAYG5D00/step_0/user/task_0", "(a SLUID), and job 42 has no SLUID"),
    ("system.slice/slurmd.service", "not a Slurm job cgroup (proctrack/linuxproc"),
    (f"{SCOPE}/system", "not a Slurm job cgroup"),
])
def test_own_cgroup_refusals(tree: Tree, where: str, reason: str) -> None:
    tree.place(where)
    choice = tree.choose()
    assert choice.path is None and reason in choice.reason
    assert not (tree.mount / where / LEAF).exists()  # nothing written when refusing


def test_own_sluid_named_task_cgroup_is_carved(tree: Tree) -> None:
    """Slurm 26.05's cgroup/v2 names the job dir by SLUID: the job's own SLUID is its cgroup,
    another job's SLUID is refused like another job's id."""
    task = tree.place(f"{SCOPE}/s8HHM8YR63YF00/step_0/user/task_0")
    (task / "cgroup.procs").write_text("")
    other = tree.choose(sluid="s8HHM8YR631300")
    assert other.path is None
    assert "(a SLUID), and job 42's SLUID is s8HHM8YR631300" in other.reason
    choice = tree.choose(sluid="s8HHM8YR63YF00")
    assert choice.path == task and choice.reason == "own cgroup (s8HHM8YR63YF00, step 0)"
    assert (task / LEAF / "cgroup.procs").read_text() == f"{PID}\n"


def test_never_above_the_job(tree: Tree) -> None:
    """The batch step's own cgroup is carvable; its job's and the scope above are never."""
    step = tree.place(f"{SCOPE}/job_42/step_batch")
    (step / "cgroup.procs").write_text("")
    assert tree.choose().path == step
    tree.place(SCOPE)
    assert tree.choose().path is None


def test_delegated_subtree_wins(tree: Tree) -> None:
    """Outside any Slurm job cgroup (proctrack/linuxproc) the prolog's subtree is the root;
    inside the job's cgroup, a subtree inside it is."""
    tree.place("system.slice/slurmd.service")
    delegated = tree.cgroup("slurm-fiber.slice/job_42")
    tree.record.write_text(f"{delegated}\n")
    choice = tree.choose()
    assert choice.path == delegated and "prolog delegated" in choice.reason
    tree.place(f"{SCOPE}/job_42/step_0/user/task_0")
    inside = tree.cgroup(f"{SCOPE}/job_42/fiber")
    tree.record.write_text(str(inside))
    assert tree.choose().path == inside


def test_delegated_subtree_outside_the_jobs_cgroup_is_refused(tree: Tree) -> None:
    """delegate_cgroup on a cgroup/v2 node: fiberd runs in its job's task cgroup, the prolog's
    subtree lies outside the job's: fibers there would leave the job's devices and limits.
    Refused, saying why, and fiberd carves its own task cgroup instead."""
    task = tree.place(f"{SCOPE}/job_42/step_0/user/task_0")
    (task / "cgroup.procs").write_text("")
    delegated = tree.cgroup("slurm-fiber.slice/job_42")
    tree.record.write_text(f"{delegated}\n")
    choice = tree.choose()
    assert choice.path == task
    assert choice.reason.startswith(
        f"delegated cgroup {delegated} refused (delegate_cgroup): it lies outside this job's "
        f"cgroup {tree.mount / SCOPE / 'job_42'}, where Slurm confines the job's devices and "
        "limits; own cgroup (job_42, step 0)")


@pytest.mark.parametrize(("recorded", "reason"), [
    ("relative/path", "is not a cgroup below the cgroup2 mount"),
    ("/etc", "is not a cgroup below the cgroup2 mount"),
    ("{mount}", "is not a cgroup below the cgroup2 mount"),
    ("{mount}/../escape", "is not a cgroup below the cgroup2 mount"),
    ("{mount}/" + SCOPE + "/job_7/step_0", "belongs to job 7, not 42"),
    ("{mount}/missing", "is not a directory"),
    ("{mount}/plain", "is not a cgroup (no cgroup.procs)"),
])
def test_bad_delegation_records_give_no_root(tree: Tree, recorded: str, reason: str) -> None:
    tree.cgroup(f"{SCOPE}/job_7/step_0")
    (tree.mount / "plain").mkdir(parents=True)
    tree.record.write_text(recorded.format(mount=tree.mount))
    choice = delegated_root(tree.record, tree.mount, 42)
    assert choice is not None and choice.path is None and reason in choice.reason


def test_no_record_and_no_mount(tree: Tree) -> None:
    assert delegated_root(tree.record, tree.mount, 42) is None
    assert choose_cgroup_root(tree.record, None, 42, PID, tree.proc).reason == (
        "no cgroup2 mount on this node")


def test_mountinfo_parsing() -> None:
    text = ("24 30 0:22 / /sys rw,nosuid shared:7 - sysfs sysfs rw\n"
            "35 25 0:29 / /sys/fs/cgroup/cpu rw shared:9 - cgroup cgroup rw,cpu\n"
            "36 25 0:30 / /sys/fs/cgroup/unified rw shared:10 - cgroup2 cgroup2 rw\n")
    assert cgroup2_mount(text) == Path("/sys/fs/cgroup/unified")
    assert cgroup2_mount(text.splitlines()[0]) is None


def test_the_builder_decides_from_the_step_env(tree: Tree, tmp_path: Path,
                                               clock: FakeClock) -> None:
    env = env_file("env_22.05_step_gpu.env")  # job 4 on n1
    task = tree.place(f"{SCOPE}/job_4/step_0/user/task_0")
    (task / "cgroup.procs").write_text("")
    config = SlurmHomeConfig(state_root=tmp_path / "state")
    home = asyncio.run(build_slurm_home(env, clock, CliControl(), config, pid=PID,
                                        proc=tree.proc))
    assert home.cgroup_root() == str(task)
    assert home.paths == job_paths(tmp_path / "state", "n1", 4)
    assert home.job.gpus == (1,) and home.job.gpu_source == "SLURM_STEP_GPUS"
