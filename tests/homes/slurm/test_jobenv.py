"""jobenv: jobs read from real 22.05 prolog/epilog/batch/step environments, and hostile ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_fiber.homes.slurm.jobenv import SlurmParseError, job_from_env, parse_index_list

FIXTURES = Path(__file__).parent / "fixtures"


def load_env(name: str) -> dict[str, str]:
    lines = (FIXTURES / name).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def test_prolog_env_of_a_gpu_job() -> None:
    job = job_from_env(load_env("env_22.05_prolog_gpu_job.env"))
    assert (job.job_id, job.uid, job.gid, job.user) == (3, 0, 0, "root")
    assert (job.partition, job.node, job.cluster) == ("debug", "n1", "citest")
    assert job.gpus == (0,) and job.gpu_source == "SLURM_JOB_GPUS"
    assert job.account == "rootacct"
    assert job.comment == "ready: warm 3 templates"
    assert job.name is None and job.end_time is None  # 22.05 gives neither to the prolog


def test_epilog_env_parses_like_the_prolog() -> None:
    assert job_from_env(load_env("env_22.05_epilog_gpu_job.env")) == job_from_env(
        load_env("env_22.05_prolog_gpu_job.env"))


def test_two_gpus_on_the_second_node() -> None:
    job = job_from_env(load_env("env_22.05_prolog_two_gpus_n2.env"))
    assert job.node == "n2" and job.gpus == (0, 1)


def test_batch_and_step_envs() -> None:
    batch = job_from_env(load_env("env_22.05_batch_gpu_job.env"))
    step = job_from_env(load_env("env_22.05_step_gpu.env"))
    assert batch.name == "plain" and batch.gpus == (1,)
    assert step.gpu_source == "SLURM_STEP_GPUS" and step.gpus == (1,)


def test_cuda_visible_devices_is_the_last_resort() -> None:
    env = load_env("env_22.05_prolog_gpu_job.env")
    del env["SLURM_JOB_GPUS"]
    env["CUDA_VISIBLE_DEVICES"] = "2,3"
    job = job_from_env(env)
    assert job.gpus == (2, 3) and job.gpu_source == "CUDA_VISIBLE_DEVICES"


def test_end_time_when_exported() -> None:
    env = load_env("env_22.05_prolog_gpu_job.env") | {"SLURM_JOB_END_TIME": "1767225600"}
    assert job_from_env(env).end_time == 1767225600


def test_sluid_when_exported() -> None:
    """Slurm 26.05 exports the job's SLUID; 22.05 and 24.11 do not."""
    assert job_from_env(load_env("env_22.05_prolog_gpu_job.env")).sluid is None
    assert job_from_env(load_env("env_26.05_step_gpu.env")).sluid == "s8HHM8YR63YF00"


@pytest.mark.parametrize(
    ("var", "value", "code"),
    [
        ("SLURM_JOB_ID", None, "missing"),
        ("SLURM_JOB_ID", "", "missing"),
        ("SLURM_JOB_ID", "12a", "invalid"),
        ("SLURM_JOB_ID", "0", "invalid"),
        ("SLURM_JOB_ID", "-3", "invalid"),
        ("SLURM_JOB_ID", "\uff14\uff12", "invalid"),  # fullwidth digits
        ("SLURM_JOB_ID", "99999999999", "invalid"),
        ("SLURM_JOB_UID", "4294967295", "invalid"),
        ("SLURM_JOB_GID", "root", "invalid"),
        ("SLURM_JOB_USER", "../etc", "invalid"),
        ("SLURM_JOB_USER", "a b", "invalid"),
        ("SLURM_JOB_PARTITION", "de bug", "invalid"),
        ("SLURMD_NODENAME", "n1/../x", "invalid"),
        ("SLURMD_NODENAME", "..", "invalid"),
        ("SLURMD_NODENAME", ".", "invalid"),
        ("SLURMD_NODENAME", "n1/x", "invalid"),
        ("SLURMD_NODENAME", "/", "invalid"),
        ("SLURMD_NODENAME", "", "missing"),
        ("SLURMD_NODENAME", "n1\x1b[2J", "invalid"),
        ("SLURMD_NODENAME", "n1\nn2", "invalid"),
        ("SLURMD_NODENAME", ".hidden", "invalid"),
        ("SLURM_CLUSTER_NAME", None, "missing"),
        ("SLURM_JOB_ACCOUNT", "a\nb", "invalid"),
        ("SLURM_JOB_GPUS", "0,x", "invalid"),
        ("SLURM_JOB_GPUS", "3-1", "invalid"),
        ("SLURM_JOB_GPUS", "0-99999", "invalid"),
        ("SLURM_JOB_END_TIME", "soon", "invalid"),
        ("SLURM_JOB_SLUID", "../job_1", "invalid"),
        ("SLURM_JOB_SLUID", "s8HHM8YR63YF0", "invalid"),
    ],
)
def test_bad_values_are_refused_with_a_code(var: str, value: str | None, code: str) -> None:
    env = load_env("env_22.05_prolog_gpu_job.env")
    if value is None:
        env.pop(var, None)
    else:
        env[var] = value
    with pytest.raises(SlurmParseError) as caught:
        job_from_env(env)
    assert caught.value.code == code
    assert var in str(caught.value) and "\n" not in str(caught.value)


def test_a_node_name_is_one_path_component_everywhere(tmp_path: Path) -> None:
    from slurm_fiber.homes.slurm.paths import gpu_resource, job_paths

    assert job_paths(tmp_path, "n1.rack-2_b+", 7).state_dir.parent.parent.name == "n1.rack-2_b+"
    for bad in ("..", ".", "", "a/b", "n1\x00", "n1\t"):
        with pytest.raises(ValueError, match="not a node name") as caught:
            job_paths(tmp_path, bad, 7)
        assert "\n" not in str(caught.value)
    assert gpu_resource("n1", 0) == "gpu:n1:0"


def test_unprintable_free_text_is_dropped_not_fatal() -> None:
    env = load_env("env_22.05_prolog_gpu_job.env") | {"SLURM_JOB_COMMENT": "x\x1b[2J"}
    assert job_from_env(env).comment is None


def test_index_lists() -> None:
    assert parse_index_list("0,2-3, 5", "X") == (0, 2, 3, 5)
    assert parse_index_list("1,1,0", "X") == (0, 1)
    assert parse_index_list("", "X") == ()


@given(st.dictionaries(st.sampled_from([
    "SLURM_JOB_ID", "SLURM_JOB_UID", "SLURM_JOB_GID", "SLURM_JOB_USER", "SLURM_JOB_PARTITION",
    "SLURMD_NODENAME", "SLURM_CLUSTER_NAME", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS",
    "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ACCOUNT", "SLURM_JOB_END_TIME"]), st.text(max_size=30)))
def test_arbitrary_environments_never_crash(env: dict[str, str]) -> None:
    try:
        job_from_env(env)
    except SlurmParseError as err:
        assert err.code in {"missing", "invalid"}


def test_the_steps_renumbered_gpu_ids_pair_with_the_nodes_indices() -> None:
    """Under ConstrainDevices Slurm gives a job's steps CUDA_VISIBLE_DEVICES from 0 while
    SLURM_STEP_GPUS/SLURM_JOB_GPUS keep the node's indices: fibers get the step's ids."""
    from slurm_fiber.core.devices import Device, DeviceChannel
    from slurm_fiber.homes.slurm.jobenv import visible_ids

    assert visible_ids({"CUDA_VISIBLE_DEVICES": "0"}, (1,), "SLURM_STEP_GPUS") == ("0",)
    assert visible_ids({"CUDA_VISIBLE_DEVICES": "0,1"}, (1, 3), "SLURM_JOB_GPUS") == ("0", "1")
    assert visible_ids({"CUDA_VISIBLE_DEVICES": "0"}, (1, 3), "SLURM_JOB_GPUS") == ()
    assert visible_ids({"CUDA_VISIBLE_DEVICES": "GPU-x"}, (1,), "SLURM_JOB_GPUS") == ()
    assert visible_ids({"CUDA_VISIBLE_DEVICES": "1"}, (1,), "CUDA_VISIBLE_DEVICES") == ()
    env = DeviceChannel.of([Device("gpu", 1, visible="0")]).env()
    assert env["CUDA_VISIBLE_DEVICES"] == env["ROCR_VISIBLE_DEVICES"] == "0"
    assert env["GPU_DEVICE_ORDINAL"] == env["ZE_AFFINITY_MASK"] == "0"
    assert DeviceChannel.of([Device("gpu", 1)]).env()["CUDA_VISIBLE_DEVICES"] == "1"
