"""The parsers on fixtures recorded from the real daemons of Slurm 24.11 and 26.05.

``docker/slurm-cluster/cluster record`` ran the same jobs on each release's container
cluster (record-fixtures.sh; the job ids are in ``recorded_<release>.json``): A, one GPU
on n1 with a name, an account and a comment; B, the second GPU of n1 (its batch and step
environments); C, two nodes with two GPUs each; D, completed; E, pending and cancelled,
its comment posing as ``JobState=``. What 22.05 gave (the bare-host recording) is
tested in test_jobenv.py and test_scontrol.py; the differences the later releases show
are asserted here by name. The job cgroups of all three releases under Slurm's cgroup/v2
(``cgroup_<release>_*``, fixtures/README.md) are tested at the end.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_fiber.homes.slurm.cgroup_layout import cgroup_of_pid, find_job_cgroup, parse_cgroup_path
from slurm_fiber.homes.slurm.cgroup_root import own_root
from slurm_fiber.homes.slurm.jobenv import SlurmParseError, job_from_env
from slurm_fiber.homes.slurm.scontrol import parse_ping, parse_show_job, parse_squeue_json

FIXTURES = Path(__file__).parent / "fixtures"
RELEASES = ("24.11", "26.05")
# Recorded with the container cluster running Slurm's cgroup/v2 (`cluster up --slurm-cgroup
# v2`, record-fixtures.sh job F): cgroup_<release>_{job.env,batch.txt,step.txt,tree.txt}.
CGROUP_RELEASES = ("22.05", "24.11", "26.05")
SCOPE = "system.slice/n1_slurmstepd.scope"


def jobs(release: str) -> dict[str, int]:
    return json.loads((FIXTURES / f"recorded_{release}.json").read_text())["jobs"]


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


def env(release: str, kind: str) -> dict[str, str]:
    lines = text(f"env_{release}_{kind}.env").splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


@pytest.mark.parametrize("release", RELEASES)
def test_prolog_and_epilog_envs(release: str) -> None:
    a = jobs(release)["A"]
    job = job_from_env(env(release, "prolog_gpu_job"))
    assert (job.job_id, job.uid, job.user, job.node, job.cluster) == (a, 2001, "sfalice", "n1",
                                                                     "docker")
    assert job.gpus == (0,) and job.gpu_source == "SLURM_JOB_GPUS"
    assert (job.account, job.comment) == ("proj1", "ready: warm 3 templates")
    # Unlike 22.05, the prolog gets SLURM_JOB_END_TIME (here the limit: a year away), and
    # the epilog the real end, so the two read the same job but for its end.
    assert job.end_time is not None
    ended = job_from_env(env(release, "epilog_gpu_job"))
    assert ended.end_time is not None and ended.end_time < job.end_time
    assert ended == replace(job, end_time=ended.end_time)
    two = job_from_env(env(release, "prolog_two_gpus_n2"))
    assert (two.job_id, two.node, two.gpus) == (jobs(release)["C"], "n2", (0, 1))


@pytest.mark.parametrize("release", RELEASES)
def test_batch_and_step_envs(release: str) -> None:
    batch = job_from_env(env(release, "batch_gpu_job"))
    step = job_from_env(env(release, "step_gpu"))
    assert batch.job_id == step.job_id == jobs(release)["B"]
    assert batch.name == "plain" and batch.gpus == (1,) and batch.gpu_source == "SLURM_JOB_GPUS"
    assert step.gpus == (1,) and step.gpu_source == "SLURM_STEP_GPUS"


@pytest.mark.parametrize("release", RELEASES)
def test_show_job(release: str) -> None:
    ids = jobs(release)
    running = parse_show_job(text(f"scontrol_show_job_{release}_running.txt"), ids["A"])
    assert running.state == "RUNNING" and running.get("Account") == "proj1"
    assert running.get("Comment") == "ready: warm 3 templates"
    detail = parse_show_job(text(f"scontrol_show_job_{release}_running_detail.txt"), ids["A"])
    assert detail.gpus_on("n1") == (0,) and detail.gpus_on("n2") == ()
    two = parse_show_job(text(f"scontrol_show_job_{release}_two_nodes_detail.txt"), ids["C"])
    assert two.gpus_on("n1") == (0, 1) and two.gpus_on("n2") == (0, 1)
    done = parse_show_job(text(f"scontrol_show_job_{release}_completed.txt"), ids["D"])
    assert done.state == "COMPLETED"
    posing = parse_show_job(text(f"scontrol_show_job_{release}_cancelled.txt"), ids["E"])
    with pytest.raises(SlurmParseError) as caught:
        _ = posing.state
    assert caught.value.code == "ambiguous"
    with pytest.raises(SlurmParseError) as unknown:
        parse_show_job(text(f"scontrol_show_job_{release}_invalid.txt"), 999999)
    assert unknown.value.code == "slurm_error" and "Invalid job id" in str(unknown.value)


@pytest.mark.parametrize("release", RELEASES)
def test_ping(release: str) -> None:
    assert parse_ping(text(f"scontrol_ping_{release}_up.txt"), 0).up
    down = parse_ping(text(f"scontrol_ping_{release}_down.txt"), 1)
    assert not down.up and down.controllers[0].role == "primary"


@pytest.mark.parametrize("release", RELEASES)
def test_squeue_json_of_running_and_ended_jobs(release: str) -> None:
    """As the home asks (--jobs, --states=all): state lists, number objects, hostlists."""
    ids = jobs(release)
    body = text(f"squeue_{release}_running_and_done.json")
    two = parse_squeue_json(body, ids["C"])
    assert two is not None and two.states == ("RUNNING",) and two.state == "RUNNING"
    assert two.nodes == ("n1", "n2") and two.gpus() == (0, 1) and two.user == "sfalice"
    assert two.end_time is not None
    first = parse_squeue_json(body, ids["A"])
    assert first is not None and first.state == "CANCELLED" and first.account == "proj1"
    assert first.comment == "ready: warm 3 templates"
    done = parse_squeue_json(body, ids["D"])
    assert done is not None and done.state == "COMPLETED"
    assert parse_squeue_json(body, 999999) is None


@pytest.mark.parametrize("release", RELEASES)
def test_squeue_with_slurmctld_unreachable_gives_no_json(release: str) -> None:
    """22.05 exits 0 with the failure in `errors`; 24.11 and 26.05 exit 1 with no JSON, only
    stderr (control.py turns that into an exit_status failure)."""
    assert not (FIXTURES / f"squeue_{release}_ctld_down.json").exists()
    assert "Unable to contact slurm controller" in text(f"squeue_{release}_ctld_down_stderr.txt")


def test_26_05_sluids_have_the_shape_the_cgroup_layout_reads() -> None:
    """26.05 names a job by its SLUID (the prolog's SLURM_JOB_SLUID, scontrol's SLUID=), which
    names its cgroup/v2 directory unless CgroupJobIdPaths=yes (seen in the cgroup_26.05_*
    recording below): every SLUID the daemons gave parses as such a directory."""
    sluid = env("26.05", "prolog_gpu_job")["SLURM_JOB_SLUID"]
    shown = parse_show_job(text("scontrol_show_job_26.05_two_nodes_detail.txt"), jobs("26.05")["C"])
    for name in (sluid, shown.get("SLUID")):
        assert name is not None
        found = parse_cgroup_path(f"/system.slice/slurmstepd.scope/{name}/step_0/user/task_0")
        assert found is not None and found.sluid == name and found.job_id is None
    assert "SLURM_JOB_SLUID" not in env("24.11", "prolog_gpu_job")


def cgroup_job(release: str) -> dict[str, str]:
    lines = text(f"cgroup_{release}_job.env").splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


@pytest.mark.parametrize("release", CGROUP_RELEASES)
def test_job_cgroups_of_slurm_cgroup_v2(release: str, tmp_path: Path) -> None:
    """What a job's processes read in /proc/self/cgroup (the v1 lines of a hybrid host, then
    0::) and the node's tree: job_<id> up to 24.11, the job's SLUID on 26.05 (which then
    gives no job id); the step's and task's levels are the same on every release."""
    job = cgroup_job(release)
    job_id, sluid = int(job["SLURM_JOB_ID"]), job.get("SLURM_JOB_SLUID")
    job_dir = sluid if release >= "26.05" else f"job_{job_id}"
    assert (sluid is not None) == (release >= "26.05")
    for part, step in (("batch", "batch"), ("step", "0")):
        (tmp_path / "proc" / part).mkdir(parents=True)
        (tmp_path / "proc" / part / "cgroup").write_text(text(f"cgroup_{release}_{part}.txt"))
        where = parse_cgroup_path(cgroup_of_pid(part, tmp_path / "proc"))
        assert where is not None, part
        assert (str(where.scope), where.job_dir, where.step, where.part, where.task) == (
            SCOPE, job_dir, step, "user", "0")
        assert (where.job_id, where.sluid) == ((None, sluid) if sluid else (job_id, None))
    tree = text(f"cgroup_{release}_tree.txt").split()
    jobs = {parse_cgroup_path(d).job_dir for d in tree if parse_cgroup_path(d)}
    assert jobs == {job_dir}
    levels = {(w.step, w.part, w.task) for d in tree if (w := parse_cgroup_path(d))}
    assert {("batch", "user", "0"), ("batch", "slurm", None), ("0", "user", "0"),
            ("0", "slurm", None)} <= levels
    assert f"{SCOPE}/system" in tree and parse_cgroup_path(f"{SCOPE}/system") is None


@pytest.mark.parametrize("release", CGROUP_RELEASES)
def test_the_home_takes_its_own_step_cgroup_in_the_recorded_tree(release: str,
                                                                 tmp_path: Path) -> None:
    """Rebuilt from the recorded tree: the step's fiberd finds its job's directory by name
    (job_<id> or the SLUID) and takes its own task cgroup, never another job's."""
    job = cgroup_job(release)
    job_id, sluid = int(job["SLURM_JOB_ID"]), job.get("SLURM_JOB_SLUID")
    mount = tmp_path / "cgroup"
    for directory in text(f"cgroup_{release}_tree.txt").split():
        (mount / directory).mkdir(parents=True, exist_ok=True)
        (mount / directory / "cgroup.procs").write_text("")
    (tmp_path / "proc" / "7").mkdir(parents=True)
    (tmp_path / "proc" / "7" / "cgroup").write_text(text(f"cgroup_{release}_step.txt"))
    where = parse_cgroup_path(cgroup_of_pid(7, tmp_path / "proc"))
    assert where is not None
    assert find_job_cgroup(mount, where.job_dir) == mount / where.job_path
    choice = own_root(mount, job_id, 7, tmp_path / "proc", sluid)
    assert choice.path == mount / where.job_path / "step_0" / "user" / "task_0", choice.reason
    other = own_root(mount, job_id + 1, 7, tmp_path / "proc", None)
    assert other.path is None
