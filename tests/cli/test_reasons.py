"""What a person sees when a fiber or a command ends badly (issue 20): the venv's
``fiberctl`` as a subprocess, and the Executor, against a real standalone fiberd whose
grant has ``limits.seconds`` 2 (fiberd's grace: 1 s).

``run``/``call``/``map`` say in one line on stderr why fiberd ended a fiber and keep
its status (``--quiet``: no line); a failed exec is said as srun says it, with a
shell's 127/126; global options work before the command as after it; the Executor's
FiberKilled names the reason.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.cli.throwaway import GRANT, Site
from slurm_fiber.client.executor import Executor, FiberKilled
from slurm_fiber.core.trust.grant import Limits
from tests.executor import fnkit
from tests.executor.sitekit import started_site, stop_site

FIBERCTL = str(Path(sys.executable).parent / "fiberctl")
IGNORES_TERM = ("sh", "-c", "trap '' TERM; sleep 30")
DEADLINE = "deadline 2 s (limits.seconds) reached"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    s = started_site(tmp_path_factory.mktemp("site"), limits=Limits(seconds=2))
    yield s
    stop_site(s)


def fiberctl(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run([FIBERCTL, *args], input=stdin, capture_output=True, text=True,
                          timeout=60, env=env)


def test_run_says_the_deadline_in_one_line_and_keeps_the_status(site: Site) -> None:
    done = fiberctl("run", "-S", str(site.socket), "--", *IGNORES_TERM)
    assert done.returncode == 128 + 9
    assert re.fullmatch(rf"fiberctl: fiber \S+ stopped: {re.escape(DEADLINE)}, killed after "
                        r"1 s grace\n", done.stderr), done.stderr
    quiet = fiberctl("run", "-S", str(site.socket), "--quiet", "--", *IGNORES_TERM)
    assert (quiet.returncode, quiet.stderr) == (128 + 9, "")


def test_call_says_why_before_the_fibers_error(site: Site) -> None:
    done = fiberctl("call", "-S", str(site.socket), "tests.executor.fnkit:sleep_then", "[60]")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert re.fullmatch(rf"fiberctl: fiber \S+ stopped: {re.escape(DEADLINE)}, ended on "
                        "SIGTERM", lines[0]), done.stderr
    assert lines[1].startswith("FiberDied: ")


def test_a_failed_exec_is_said_as_srun_says_it_with_a_shells_status(
        site: Site, tmp_path: Path) -> None:
    missing = fiberctl("run", "-S", str(site.socket), "--", "/nonexistent")
    assert (missing.returncode, missing.stderr) == (
        127, "fiberctl: execve(): /nonexistent: No such file or directory\n")
    plain = tmp_path / "notes.txt"
    plain.write_text("not a program\n")
    denied = fiberctl("run", "-S", str(site.socket), "--", str(plain))
    assert (denied.returncode, denied.stderr) == (
        126, f"fiberctl: execve(): {plain}: Permission denied\n")
    script = tmp_path / "script"
    script.write_text("#!/no/such/python\n")
    script.chmod(0o755)
    bad = fiberctl("run", "-S", str(site.socket), "--", str(script))
    assert (bad.returncode, bad.stderr) == (
        126, f"fiberctl: execve(): {script}: /no/such/python: bad interpreter: "
        "No such file or directory\n")
    mapped = fiberctl("map", "-S", str(site.socket), "--", "/nonexistent", "{}", stdin="a\n")
    assert mapped.returncode == 1
    assert "fiberctl: execve(): /nonexistent: No such file or directory\n" in mapped.stderr
    quiet = fiberctl("map", "-q", "-S", str(site.socket), "--", "/nonexistent", stdin="a\n")
    assert (quiet.returncode, quiet.stderr) == (1, "")


def test_global_options_before_the_command_as_after_it(site: Site) -> None:
    sock = str(site.socket)
    for words in (["--socket", sock, "status", "--json"], ["--json", f"--socket={sock}", "status"],
                  ["-S", sock, "--json", "status"], ["status", "--socket", sock, "--json"]):
        done = fiberctl(*words)
        assert done.returncode == 0, (words, done.stderr)
        assert json.loads(done.stdout)["ready"] is True
    listed = fiberctl("--json", "--socket", sock, "ls")
    assert listed.returncode == 0 and isinstance(json.loads(listed.stdout), list)
    ran = fiberctl("--socket", sock, "--grant", GRANT, "run", "--", "sh", "-c", "exit 5")
    assert ran.returncode == 5
    called = fiberctl("-S", sock, "-g", GRANT, "--quiet", "call", "tests.executor.fnkit:square",
                      "[7]")
    assert (called.returncode, called.stdout) == (0, "49\n")
    mapped = fiberctl("--socket", sock, "map", "--", "echo", "{}", stdin="x\n")
    assert (mapped.returncode, mapped.stdout) == (0, "x\n")
    waited = fiberctl("--socket", sock, "wait", "--timeout", "10")
    assert waited.returncode == 0
    as_json = fiberctl("--json", "--socket", sock, "run", "--", "true")
    assert as_json.returncode == 0, as_json.stderr  # run prints its outcome as JSON too
    assert json.loads(as_json.stdout)["reason"] is None


def test_the_executors_fiber_killed_names_the_reason(site: Site) -> None:
    with Executor(socket=site.socket, max_workers=1) as pool:
        future = pool.submit(fnkit.sleep_then, 60)
        with pytest.raises(FiberKilled) as caught:
            future.result(timeout=60)
    assert caught.value.reason is not None and caught.value.reason["code"] == "deadline"
    assert str(caught.value).endswith(f"was killed by SIGTERM: {DEADLINE}, ended on SIGTERM")


SLURM_FIBER = str(Path(sys.executable).parent / "slurm-fiber")


def test_command_errors_name_the_path_and_what_to_do(tmp_path: Path) -> None:
    file = tmp_path / "plain"
    file.write_text("not a dir\n")
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # bound, closed: nothing listens
    cases = [
        ((FIBERCTL, "--socket", str(tmp_path / "none.sock"), "status"), 69,
         f"fiberctl: cannot connect to fiberd at {tmp_path / 'none.sock'}: no such socket; "
         "is fiberd running?"),
        ((FIBERCTL, "ls", "--socket", str(file)), 69,
         f"fiberctl: cannot connect to fiberd at {file}: not a socket; give --socket"),
        ((FIBERCTL, "ls", "--socket", str(stale)), 69, "nothing listens there (a stale socket)"),
        ((FIBERCTL, "run", "-S", str(stale), "--token", str(tmp_path), "--", "true"), 2,
         f"fiberctl: cannot read token file {tmp_path}: Is a directory; --token wants a file"),
        ((SLURM_FIBER, "keys", "gen", "--issuer", "site", "--out", str(file)), 1,
         f"slurm-fiber: keys gen: --out {file} is not a directory"),
        ((SLURM_FIBER, "audit", "--state-dir", str(file)), 1,
         f"{file} is not fiberd's state dir (give --state-dir a directory)"),
        ((SLURM_FIBER, "audit", "--path", str(tmp_path / "none.jsonl")), 1,
         "no audit log there: give --path the log or --state-dir"),
    ]
    for argv, status, words in cases:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == status, (argv, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert words in done.stderr, (argv, done.stderr)
    assert file.read_text() == "not a dir\n"
