"""cgroup_layout on a Slurm-shaped cgroup v2 tree the test builds (real dirs, /proc files)."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import pytest

from slurm_fiber.homes.slurm.cgroup_layout import (
    cgroup_of_pid,
    find_job_cgroup,
    job_cgroup_of_pid,
    job_dir_name,
    parse_cgroup_path,
)
from slurm_fiber.homes.slurm.jobenv import SlurmParseError

SCOPE = "system.slice/slurmstepd.scope"


@pytest.mark.parametrize(
    ("path", "job_id", "sluid", "step", "part", "task", "inner"),
    [
        (f"/{SCOPE}/job_42", 42, None, None, None, None, None),
        (f"/{SCOPE}/job_42/step_0/user/task_3", 42, None, "0", "user", "3", None),
        (f"/{SCOPE}/job_42/step_batch/user/task_0", 42, None, "batch", "user", "0", None),
        (f"/{SCOPE}/job_42/step_extern/user/task_special", 42, None, "extern", "user",
         "special", None),
        (f"/{SCOPE}/job_42/step_interactive/slurm", 42, None, "interactive", "slurm", None, None),
        (f"/{SCOPE}/job_42/step_1+2/user/task_4294967293", 42, None, "1+2", "user",
         "4294967293", None),
        (f"/{SCOPE}/job_42/step_0/user/task_0/fiberd/t1", 42, None, "0", "user", "0",
         "fiberd/t1"),
        (f"/{SCOPE}/job_42/fiberd", 42, None, None, None, None, "fiberd"),
        ("/system.slice/n1_slurmstepd.scope/job_7/step_0/user/task_0", 7, None, "0", "user",
         "0", None),
        (f"/{SCOPE}/s5K1KKYAYG5D00/step_0/user/task_0", None, "s5K1KKYAYG5D00", "0", "user",
         "0", None),
    ],
)
def test_paths_map_to_job_and_step(path: str, job_id: int | None, sluid: str | None,
                                   step: str | None, part: str | None, task: str | None,
                                   inner: str | None) -> None:
    where = parse_cgroup_path(path)
    assert where is not None
    assert (where.job_id, where.sluid, where.step, where.part, where.task) == (
        job_id, sluid, step, part, task)
    assert where.inner == (PurePosixPath(inner) if inner else None)
    assert str(where.job_path).endswith(where.job_dir)


@pytest.mark.parametrize("path", [
    "/", "/user.slice/user-0.slice/session-1.scope", f"/{SCOPE}", f"/{SCOPE}/system",
    f"/{SCOPE}/job_x", f"/{SCOPE}/job_", f"/{SCOPE}/../job_1", "/job_1/step_0",
    f"/{SCOPE}/job_99999999999",
    # not SLUIDs as Slurm prints them: "s" and exactly 13 of Crockford's base32
    f"/{SCOPE}/s5K1KKYAYG5D0", f"/{SCOPE}/s5K1KKYAYG5D000", f"/{SCOPE}/S5K1KKYAYG5D00",
    f"/{SCOPE}/s5K1KKYAYG5DU0", f"/{SCOPE}/s5k1kkyayg5d00",
])
def test_paths_outside_jobs_are_none(path: str) -> None:
    assert parse_cgroup_path(path) is None


def test_step_path() -> None:
    where = parse_cgroup_path(f"/{SCOPE}/job_5/step_batch/user/task_0")
    assert where is not None and where.step_path == PurePosixPath(SCOPE, "job_5", "step_batch")


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A cgroup mount with two jobs (one SLUID-named) and a fake /proc for three processes."""
    mount, proc = tmp_path / "cgroup", tmp_path / "proc"
    for rel in (f"{SCOPE}/job_11/step_0/user/task_0", f"{SCOPE}/job_11/step_extern/slurm",
                f"{SCOPE}/system", "system.slice/n2_slurmstepd.scope/job_12/step_batch/user/task_0",
                f"{SCOPE}/s5K1KKYAYG5D00/step_0/user/task_1", "user.slice"):
        (mount / rel).mkdir(parents=True)
    for pid, line in {"100": f"0::/{SCOPE}/job_11/step_0/user/task_0",
                      "101": "0::/user.slice", "102": "12:memory:/x\n"}.items():
        (proc / pid).mkdir(parents=True)
        (proc / pid / "cgroup").write_text(line + "\n")
    return mount, proc


def test_job_cgroup_of_a_process(tree: tuple[Path, Path]) -> None:
    mount, proc = tree
    assert job_cgroup_of_pid(100, mount, proc) == mount / SCOPE / "job_11"
    assert (job_cgroup_of_pid(100, mount, proc) / "step_0").is_dir()
    assert job_cgroup_of_pid(101, mount, proc) is None
    with pytest.raises(SlurmParseError):
        job_cgroup_of_pid(102, mount, proc)
    with pytest.raises(OSError):
        job_cgroup_of_pid(103, mount, proc)


def test_find_job_cgroup_in_any_scope(tree: tuple[Path, Path]) -> None:
    mount, _ = tree
    assert find_job_cgroup(mount, job_dir_name(11)) == mount / SCOPE / "job_11"
    assert find_job_cgroup(mount, "job_12") == mount / "system.slice/n2_slurmstepd.scope/job_12"
    assert find_job_cgroup(mount, "s5K1KKYAYG5D00") == mount / SCOPE / "s5K1KKYAYG5D00"
    assert find_job_cgroup(mount, "job_13") is None
    assert find_job_cgroup(mount, "../user.slice") is None
    assert find_job_cgroup(mount, "system") is None
    assert find_job_cgroup(mount / "missing", "job_11") is None


def test_this_process_has_a_v2_cgroup_line() -> None:
    assert str(cgroup_of_pid(os.getpid())).startswith("/")
