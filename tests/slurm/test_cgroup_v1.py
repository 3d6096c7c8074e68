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
