"""scontrol/squeue parsers on recorded 22.05 output and hostile text (24.11 and 26.05:
test_releases.py)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_fiber.homes.slurm.jobenv import SlurmParseError
from slurm_fiber.homes.slurm.scontrol import (
    expand_hostlist,
    gpu_indices_from_gres,
    parse_ping,
    parse_show_job,
    parse_squeue_json,
)

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_running_job_with_spaces_in_values() -> None:
    job = parse_show_job(fixture("scontrol_show_job_22.05_running.txt"), 3)
    assert job.job_id == 3 and job.state == "RUNNING"
    assert job.get("JobName") == "fiber test job"
    assert job.get("Comment") == "ready: warm 3 templates"
    assert job.get("Command") == "/tmp/rec/job.sh arg1 two words"
    assert job.get("UserId") == "root(0)" and job.get("Partition") == "debug"
    assert job.get("ReqB:S:C:T") == "0:0:*:*" and job.get("Power") == ""
    assert job.get("TRES") == "cpu=1,mem=512M,node=1,billing=1"


def test_detail_gives_gpus_per_node() -> None:
    one = parse_show_job(fixture("scontrol_show_job_22.05_running_detail.txt"), 3)
    assert one.gpus_on("n1") == (0,) and one.gpus_on("n2") == ()
    text = fixture("scontrol_show_job_22.05_two_nodes_detail.txt")
    job_id = int(text.split()[0].removeprefix("JobId="))
    two = parse_show_job(text, job_id)
    assert two.gpus_on("n1") == (0, 1) and two.gpus_on("n2") == (0, 1)


def test_finished_states() -> None:
    assert parse_show_job(fixture("scontrol_show_job_22.05_completed.txt"), 3).state == "COMPLETED"


def test_a_comment_posing_as_a_key_is_ambiguous_not_trusted() -> None:
    text = fixture("scontrol_show_job_22.05_cancelled.txt")
    job = parse_show_job(text, 5)
    with pytest.raises(SlurmParseError) as caught:
        _ = job.state
    assert caught.value.code == "ambiguous"


def test_text_posing_as_node_details_is_ambiguous() -> None:
    real = fixture("scontrol_show_job_22.05_running_detail.txt")
    spoofed = real.replace("Comment=ready: warm 3 templates",
                           "Comment=x Nodes=n2 GRES=gpu:2(IDX:0-1)")
    job = parse_show_job(spoofed, 3)
    with pytest.raises(SlurmParseError):
        job.gpus_on("n2")


def test_unknown_job_and_empty_output() -> None:
    with pytest.raises(SlurmParseError) as caught:
        parse_show_job(fixture("scontrol_show_job_22.05_invalid.txt"), 99999)
    assert caught.value.code == "slurm_error" and "Invalid job id" in str(caught.value)
    with pytest.raises(SlurmParseError):
        parse_show_job("", 1)
    with pytest.raises(SlurmParseError) as other:
        parse_show_job(fixture("scontrol_show_job_22.05_running.txt"), 4)
    assert other.value.code == "missing"


def test_ping_up_down_and_backup() -> None:
    assert parse_ping(fixture("scontrol_ping_22.05_up.txt"), 0).up
    down = parse_ping(fixture("scontrol_ping_22.05_down.txt"), 1)
    assert not down.up and down.controllers[0].role == "primary"
    failover = parse_ping(fixture("scontrol_ping_24.11_handwritten_backup.txt"), 1)
    assert failover.up and [c.up for c in failover.controllers] == [False, True]
    with pytest.raises(SlurmParseError) as caught:
        parse_ping("scontrol: error: something else\n", 1)
    assert caught.value.code == "unrecognised"


def test_squeue_22_05_filters_by_job_id_itself() -> None:
    text = fixture("squeue_22.05_running_and_done.json")
    running = parse_squeue_json(text, 6)
    assert running is not None and running.state == "RUNNING"
    assert running.nodes == ("n1", "n2") and running.gpus() == (0, 1)
    assert running.end_time == 1796237443 and running.user == "root"
    done = parse_squeue_json(text, 3)
    assert done is not None and done.state == "COMPLETED"
    assert done.comment == "ready: warm 3 templates" and done.account == "rootacct"
    assert parse_squeue_json(text, 999) is None


@pytest.mark.parametrize("name", ["squeue_22.05_ctld_down.json"])  # 24.11+: no JSON
def test_squeue_errors_list_is_a_failure(name: str) -> None:
    with pytest.raises(SlurmParseError) as caught:
        parse_squeue_json(fixture(name), 1)
    assert caught.value.code == "slurm_error"


@pytest.mark.parametrize("text", ["", "not json", "[]", '{"jobs": 3}',
                                  '{"jobs": [{"job_id": 1, "job_state": 7}]}'])
def test_squeue_garbage(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_squeue_json(text, 1)


def test_hostlists_and_gres() -> None:
    assert expand_hostlist("n[1-2],gpu[08-10]x,login") == (
        "n1", "n2", "gpu08x", "gpu09x", "gpu10x", "login")
    assert expand_hostlist("r[1-2]n[1-2]") == ("r1n1", "r1n2", "r2n1", "r2n2")
    for bad in ("n[1-2", "n[a-b]", "n[5-1]", "n]x[", "n[0-9999999]"):
        with pytest.raises(SlurmParseError):
            expand_hostlist(bad)
    assert gpu_indices_from_gres("gpu:a100:2(IDX:1,3),gpu:1(IDX:5)") == (1, 3, 5)
    assert gpu_indices_from_gres("gpu:0(IDX:N/A)") == ()


@given(st.text(max_size=300))
def test_show_job_never_crashes(text: str) -> None:
    try:
        job = parse_show_job("JobId=7 " + text, 7)
        job.gpus_on("n1")
        _ = job.state
    except SlurmParseError:
        pass


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                    lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(st.sampled_from(
                        ["job_id", "job_state", "nodes", "gres_detail", "end_time", "set",
                         "number", "jobs", "errors"]), kids, max_size=4), max_leaves=12))
def test_squeue_json_never_crashes(doc: object) -> None:
    with contextlib.suppress(SlurmParseError):
        parse_squeue_json(json.dumps({"jobs": [doc]} if isinstance(doc, dict) else doc), 1)
