"""The real `slurm-fiber lease` console script: tables, --json, refusals and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = str(Path(sys.executable).with_name("slurm-fiber"))


@pytest.fixture
def run(tmp_path: Path):
    env = {**os.environ, "SLURM_FIBER_LEASE_DIR": str(tmp_path / "leases")}
    env.pop("SLURM_FIBER_SESSION", None)

    def call(*args: str, session: str = "") -> subprocess.CompletedProcess[str]:
        extra = ["--session", session] if session else []
        return subprocess.run([SCRIPT, "lease", *args, *extra], env=env,
                              capture_output=True, text=True, timeout=60)

    return call


def test_claim_ls_release_human_and_json(run, tmp_path: Path) -> None:
    got = run("claim", "gpu0", "--purpose", "train resnet", "--budget", "8")
    assert got.returncode == 0 and "claimed gpu0 (8 GiB)" in got.stdout
    table = run("ls")
    assert table.returncode == 0
    assert table.stdout.splitlines()[0].split() == ["RESOURCE", "HOLDER", "SINCE", "STALE",
                                                     "PURPOSE"]
    assert "train resnet" in table.stdout
    doc = json.loads(run("ls", "--json").stdout)
    assert doc["leases"][0]["budgetGiB"] == 8 and doc["leases"][0]["stale"] is None
    on_disk = json.loads((tmp_path / "leases" / "gpu0" / "holder.json").read_text())
    assert on_disk["env"] == "gpu0" and f"@pid:{os.getpid()}:" in on_disk["session"]
    taken = run("claim", "gpu0", "--purpose", "x", session="other")
    assert taken.returncode == 1 and taken.stderr.startswith("refused: gpu0 (8 GiB) is held")
    assert len(taken.stderr.strip().splitlines()) == 1
    assert run("release", "gpu0").returncode == 0
    assert json.loads(run("ls", "--json").stdout)["leases"] == []


def test_allot_queue_refusal_prints_position_and_ahead(run) -> None:
    assert run("supervise", "start", session="sup").returncode == 0
    assert "number 1" in run("allot", "gpu0", "--to", "a", session="sup").stdout
    second = run("allot", "gpu0", "--to", "b", "--json", session="sup")
    assert json.loads(second.stdout)["position"] == 2
    behind = run("claim", "gpu0", "--purpose", "x", session="b")
    assert behind.returncode == 1
    assert "[position 2, ahead: a]" in behind.stderr
    as_json = json.loads(run("claim", "gpu0", "--purpose", "x", "--json", session="b").stdout)
    assert (as_json["position"], as_json["ahead"]) == (2, "a")
    ungranted = run("claim", "gpu0", "--purpose", "x", session="c")
    assert ungranted.returncode == 1 and "a free lease is not a grant" in ungranted.stderr
    assert "`slurm-fiber lease allot gpu0 --to c`" in ungranted.stderr
    assert run("claim", "gpu0", "--purpose", "x", session="a").returncode == 0
    assert "grant: gpu0 -> b" in run("ls").stdout
    assert run("supervise", "stop", session="sup").returncode == 0
    assert run("claim", "gpu1", "--purpose", "x", session="c").returncode == 0
    assert run("prune").returncode == 0


def test_steal_stale_from_a_gone_shell(run, tmp_path: Path) -> None:
    gone = subprocess.run(["bash", "-c", f'"{SCRIPT}" lease claim gpu0 --purpose crashed; exit $?'],
                          env={**os.environ, "SLURM_FIBER_LEASE_DIR": str(tmp_path / "leases")},
                          capture_output=True, text=True)
    assert gone.returncode == 0, gone.stderr
    assert json.loads(run("ls", "--json").stdout)["leases"][0]["stale"]
    assert "STALE" in run("ls").stdout and " yes " in run("ls").stdout
    assert run("claim", "gpu0", "--purpose", "mine", session="new").returncode == 1
    stolen = run("claim", "gpu0", "--purpose", "mine", "--steal-stale", session="new")
    assert stolen.returncode == 0, stolen.stderr
    audit = (tmp_path / "leases" / "audit.jsonl").read_text().splitlines()
    assert json.loads(audit[0])["action"] == "steal-stale"


@pytest.mark.parametrize(
    "args",
    [
        ("claim", "a/b", "--purpose", "x"),
        ("claim", "..", "--purpose", "x"),
        ("claim", "gpu0", "--purpose", "y" * 100_000),
        ("allot", "gpu0", "--to", "a"),
        ("release", "gpu0\x01"),
    ],
)
def test_bad_input_is_one_line_exit_1(run, args: tuple[str, ...]) -> None:
    got = run(*args)
    assert got.returncode == 1
    assert got.stderr.startswith("error: ") and len(got.stderr.strip().splitlines()) == 1
    assert "Traceback" not in got.stderr + got.stdout


def test_usage_error_exits_2_and_help_teaches(run) -> None:
    assert run("claim", "gpu0").returncode == 2
    helptext = run("claim", "--help").stdout
    assert "--steal-stale" in helptext and "--purpose" in helptext


def test_a_file_given_as_the_lease_dir_is_named_not_a_directory(run, tmp_path: Path) -> None:
    file = tmp_path / "passwd"
    file.write_text("root:x:0:0::/root:/bin/sh\n")
    for args, what in ((("--dir", str(file), "ls"), "the lease dir (--dir"),
                       (("--dir", str(file / "sub"), "ls"), "the lease dir (--dir"),
                       (("--dir", str(file), "claim", "gpu0", "--purpose", "x"),
                        "the state document's dir (--state, by default --dir)"),
                       (("--state", str(file / "state.json"), "ls"), "(--state")):
        got = run(*args)
        assert got.returncode == 1, args
        line = got.stderr.strip()
        assert len(line.splitlines()) == 1, got.stderr
        assert line.startswith(f"error: {file} is not a directory"), line
        assert what in line and line.endswith("must be one"), line
    assert file.read_text() == "root:x:0:0::/root:/bin/sh\n"


def test_a_ttl_that_is_not_positive_is_a_usage_error_naming_it(run) -> None:
    got = run("--ttl", "-5", "ls")
    assert got.returncode == 2 and "--ttl" in got.stderr and "positive" in got.stderr


def test_grant_is_a_hidden_deprecated_alias_of_allot(run) -> None:
    assert run("supervise", "start", session="sup").returncode == 0
    old = run("grant", "gpu0", "--to", "a", "--json", session="sup")
    assert old.returncode == 0 and json.loads(old.stdout)["position"] == 1
    assert "'grant' is deprecated" in old.stderr
    assert json.loads(run("ls", "--json").stdout)["grants"][0]["resource"] == "gpu0"
    listed = run("--help").stdout
    commands = {line.split()[0] for line in listed.splitlines() if line.startswith("  ")}
    assert "allot" in commands and "grant" not in commands
