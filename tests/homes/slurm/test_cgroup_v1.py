"""homes.slurm.cgroup_v1: finding a job's groups in Slurm's cgroup v1 layout.

The tree is built by the test (directories with a ``tasks`` file, as v1
hierarchies have, and none for the cgroup2 mount); the real layout on the
cluster is covered by test_fiberd_job and test_slurm_cgroup.
"""

from __future__ import annotations

from pathlib import Path

from slurm_fiber.homes.slurm.cgroup_v1 import job_groups, read_cgroup_conf


def hierarchy(mount: Path, name: str, *groups: str) -> Path:
    root = mount / name
    root.mkdir(parents=True)
    (root / "tasks").write_text("")
    for group in groups:
        (root / group).mkdir(parents=True)
    return root


def conf(tmp_path: Path, text: str) -> str:
    (tmp_path / "etc").mkdir(exist_ok=True)
    (tmp_path / "etc" / "cgroup.conf").write_text(text)
    return str(tmp_path / "etc" / "slurm.conf")


def test_the_jobs_groups_in_every_v1_hierarchy_of_the_mountpoint(tmp_path: Path) -> None:
    mount = tmp_path / "cg"
    job = "slurm_n1/uid_995/job_7/step_0/slurm-fiber.12"
    freezer = hierarchy(mount, "freezer", job, "slurm_n1/uid_995/job_8")
    memory = hierarchy(mount, "memory", job, "slurm_n2/uid_995/job_7")
    (mount / "unified" / "slurm_n1" / "uid_995" / "job_7").mkdir(parents=True)  # no tasks file
    slurm_conf = conf(tmp_path, f"CgroupPlugin=cgroup/v1  # comment\ncgroupmountpoint = {mount}\n")
    assert job_groups(slurm_conf, "n1", 995, 7) == [
        freezer / "slurm_n1/uid_995/job_7", memory / "slurm_n1/uid_995/job_7"]
    assert job_groups(slurm_conf, "n1", 996, 7) == []


def test_a_single_slurmd_prefix_and_a_v2_node(tmp_path: Path) -> None:
    mount = tmp_path / "cg"
    devices = hierarchy(mount, "devices", "slurm/uid_0/job_3")
    assert job_groups(conf(tmp_path, f"CgroupMountpoint={mount}\n"), "n1", 0, 3) == [
        devices / "slurm/uid_0/job_3"]
    v2 = conf(tmp_path, f"CgroupPlugin=cgroup/v2\nCgroupMountpoint={mount}\n")
    assert job_groups(v2, "n1", 0, 3) == []


def test_no_cgroup_conf_reads_as_slurms_defaults(tmp_path: Path) -> None:
    assert read_cgroup_conf(tmp_path / "slurm.conf") == {}
    assert job_groups(None, "n1", 0, 3) == job_groups(str(tmp_path / "slurm.conf"), "n1", 0, 3)


MOUNTINFO = """\
40 27 0:32 /process_api/x/slurm-cluster-citest-1 /run/c/memory rw - cgroup cgroup rw,memory
30 27 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
31 27 0:33 /slurm-cluster-citest-1 /run/c/freezer rw - cgroup cgroup rw,freezer
"""
PROC_CGROUP = """\
6:freezer:/slurm-cluster-citest-1/slurm_n1/uid_995/job_4/step_0
4:memory:/process_api/x/slurm-cluster-citest-1/slurm_n1/uid_995/job_4/step_0/task_0
0::/
"""


def test_a_job_inside_a_bind_mounted_cgroup_mountpoint_carves_below_its_own_groups() -> None:
    """The test cluster's CgroupMountpoint holds bind mounts of groups: fiberd carves in the
    hierarchy mounted whole where there is one, else through the bind mount it has."""
    from slurm_fiber.core.cgroups.v1 import V1Layout

    layout = V1Layout.parse(MOUNTINFO, PROC_CGROUP)
    assert layout.root("memory", "slurm-fiber.9") == Path(
        "/sys/fs/cgroup/memory/process_api/x/slurm-cluster-citest-1/slurm_n1/uid_995/job_4/"
        "step_0/task_0/slurm-fiber.9")
    assert layout.root("freezer", "slurm-fiber.9") == Path(
        "/run/c/freezer/slurm_n1/uid_995/job_4/step_0/slurm-fiber.9")
