"""fiberctl as a user runs it (a real subprocess) against a served real-process Service."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_fiber.client.connection import FiberdClient

FIBERCTL = str(Path(sys.executable).with_name("fiberctl"))
WAITS_FOR_SIGINT = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGINT, lambda *a: (print('caught', flush=True), sys.exit(42)))\n"
    "print('ready', flush=True)\n"
    "time.sleep(30)\n"
)
IGNORES_SIGINT = (
    "import signal, time\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(30)\n"
)


def fiberctl(served, *args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FIBERCTL, *args[:1], "--socket", str(served.path), *args[1:]],
                          capture_output=True, text=True, timeout=30, **kw)


def start(served, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([FIBERCTL, "run", "--socket", str(served.path), "--", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_run_passes_stdio_streams_live_and_returns_the_status(served) -> None:
    proc = start(served, "sh", "-c", "echo one; read x; echo got $x; exit 7")
    assert proc.stdout.readline() == "one\n"  # live: the fiber is still waiting for stdin
    assert proc.poll() is None
    out, _ = proc.communicate("hi\n", timeout=10)
    assert out == "got hi\n"
    assert proc.returncode == 7


def test_run_runs_in_the_callers_directory(served, tmp_path) -> None:
    done = fiberctl(served, "run", "--", "pwd", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, f"{tmp_path}\n")


def test_run_reports_a_killing_signal_as_128_plus_n(served) -> None:
    assert fiberctl(served, "run", "--", "sh", "-c", "kill -TERM $$").returncode == 128 + 15


def test_ctrl_c_reaches_the_fiber(served) -> None:
    proc = start(served, sys.executable, "-c", WAITS_FOR_SIGINT)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=10)
    assert (out, proc.returncode) == ("caught\n", 42)


def test_second_ctrl_c_kills_a_fiber_that_ignores_the_first(served) -> None:
    proc = start(served, sys.executable, "-c", IGNORES_SIGINT)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    fid = next(iter(served.service.fibers))
    served.call(lambda: _until_signalled(served, fid, 1))
    assert proc.poll() is None  # the fiber ignored SIGINT and still runs
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=10)
    assert proc.returncode == 128 + 9
    assert served.service.fibers[fid].signals == [signal.SIGINT, signal.SIGKILL]


async def _until_signalled(served, fid: str, count: int) -> None:
    while len(served.service.fibers[fid].signals) < count:
        await asyncio.sleep(0.01)


def test_call_prints_the_json_result_or_fails_with_the_error(served) -> None:
    done = fiberctl(served, "call", "operator:add", "[2, 3]")
    assert (done.returncode, done.stdout) == (0, "5\n")
    done = fiberctl(served, "call", "math:sqrt", "[-1]")
    assert (done.returncode, done.stderr) == (1, "ValueError: math domain error\n")
    assert fiberctl(served, "call", "math:sqrt", "not json").returncode == 2


@pytest.mark.parametrize(("grant", "code", "line"), [
    ("cold-1", 75, "cold: template still warming\n"),
    ("gone-1", 77, "unknown_grant: no grant gone-1 here\n"),
])
def test_a_miss_is_one_line_and_a_distinct_exit_code(served, grant, code, line) -> None:
    # --no-wait: a retryable miss exits at once (by default run waits through it,
    # tests/cli/test_fiberctl_wait.py)
    done = fiberctl(served, "run", "--no-wait", "--grant", grant, "--", "true")
    assert (done.returncode, done.stderr, done.stdout) == (code, line, "")


def test_refusal_and_unreachable_exit_codes(served, tmp_path) -> None:
    # a refusal exits 1, as in every slurm_fiber command (it was 65 before issue 15)
    done = fiberctl(served, "run", "-e", "CUDA_VISIBLE_DEVICES=0", "--", "true")
    assert done.returncode == 1 and done.stderr.startswith("bad_request: ")
    done = subprocess.run([FIBERCTL, "status", "--socket", str(tmp_path / "none.sock")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 69 and done.stderr.count("\n") == 1


def test_ls_stop_and_status(served) -> None:
    with FiberdClient(served.path) as c:
        fid = c.clone(exec={"argv": ["sleep", "30"]})["id"]
    listed = json.loads(fiberctl(served, "ls", "--json").stdout)
    assert [(f["id"], f["state"]) for f in listed] == [(fid, "running")]
    assert fid in fiberctl(served, "ls").stdout
    assert fiberctl(served, "stop", fid, "--grace", "1").stdout == f"stopped {fid}\n"
    assert json.loads(fiberctl(served, "ls", "--json").stdout)[0]["state"] == "exited"
    assert fiberctl(served, "stop", "nope").returncode == 1
    report = json.loads(fiberctl(served, "status", "--json").stdout)
    assert report["ready"] is True and report["status"]["home"] == "test"


def test_inspect_and_kill_a_fiber(served) -> None:
    with FiberdClient(served.path) as c:
        fid = c.clone(exec={"argv": ["sleep", "30"]})["id"]
    record = json.loads(fiberctl(served, "inspect", fid, "--json").stdout)
    assert (record["id"], record["state"]) == (fid, "running")
    assert f"id: {fid}\n" in fiberctl(served, "inspect", fid).stdout
    sent = fiberctl(served, "kill", fid, "-s", "cont")  # harmless: sleep goes on
    assert (sent.returncode, sent.stdout) == (0, f"sent SIGCONT to {fid}\n")
    assert served.service.fibers[fid].signals == [signal.SIGCONT]
    done = fiberctl(served, "kill", fid, "--json")  # default TERM: sleep dies of it
    assert json.loads(done.stdout) == {"fiber": fid, "signal": "SIGTERM", "delivered": True}
    served.call(served.service.fibers[fid].wait)
    late = fiberctl(served, "kill", fid, "-s", "9")
    assert late.returncode == 1
    assert late.stderr == f"fiberctl: fiber {fid} has already exited; SIGKILL not sent\n"
    assert fiberctl(served, "kill", fid, "-s", "NOPE").returncode == 2
    missing = fiberctl(served, "inspect", "nope")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1


def test_grants_lists_what_fiberd_holds(served) -> None:
    assert json.loads(fiberctl(served, "grants", "--json").stdout) == [
        {"uid": "g1", "state": "warm"}]
    table = fiberctl(served, "grants").stdout.splitlines()
    assert table[0].split() == ["UID", "STATE", "FIBERS", "LEASE_END", "EXPIRED"]
    assert table[1].split()[:2] == ["g1", "warm"]


def test_metrics_prints_the_prometheus_text(served) -> None:
    text = fiberctl(served, "metrics").stdout
    assert "# TYPE slurm_fiber_clones_total counter" in text
    reply = json.loads(fiberctl(served, "metrics", "--json").stdout)
    assert reply["text"] == text and reply["content_type"].startswith("text/plain")


def test_every_command_help_states_the_exit_codes() -> None:
    for command in ("run", "call", "ls", "inspect", "stop", "kill", "grants", "status",
                    "metrics", "wait"):
        done = subprocess.run([FIBERCTL, command, "--help"], capture_output=True, text=True,
                              timeout=30)
        assert "1 refused or failed" in " ".join(done.stdout.split()), command
    top = subprocess.run([FIBERCTL, "--help"], capture_output=True, text=True, timeout=30)
    assert top.returncode == 0 and "run" in top.stdout and "map" in top.stdout


def test_socket_discovery_from_the_environment(served) -> None:
    env = {"PATH": "/usr/bin:/bin", "FIBERD_SOCKET": str(served.path)}
    done = subprocess.run([FIBERCTL, "status"], capture_output=True, text=True, env=env,
                          timeout=30)
    assert done.returncode == 0 and "ready: True" in done.stdout


@pytest.mark.parametrize("argv", [
    ["run", "--", "true"],
    ["run", "-q", "-S", "/s", "-g", "g1", "-e", "A=1", "--env=B=2", "--", "sh", "-c", "a -- b"],
    ["run", "--socket=/s", "--token", "/tok", "true", "x"],
    ["run", "--quiet", "--grant=g", "--", "-x", "--", "-q"],
    ["call", "m:f"],
    ["call", "-q", "m:f", "[1, 2]"],
    ["call", "--grant", "g", "-t", "/tok", "m:f", "{}"],
    ["call", "m:f", "{}", "--grant", "g"],
    ["run", "a", "-q", "--", "b"],
])
def test_quick_parse_means_what_argparse_means(argv: list[str]) -> None:
    from slurm_fiber.client.fiberctl import parse, quick_parse

    quick = quick_parse(argv)
    assert quick is not None and vars(quick) == vars(parse(argv))


@pytest.mark.parametrize("argv", [
    ["run", "-h"], ["run", "--all", "--", "x"], ["run", "-e"], ["run", "-e", "-q", "x"],
    ["run", "-q=1", "x"], ["call"], ["call", "a", "b", "c"], ["call", "m:f", "--", "x"],
    ["status"], ["ls", "--json"], ["call", "m:f", "--grant", "g", "{}"], ["run", "a", "-q", "b"],
])
def test_anything_not_plain_is_left_to_argparse(argv: list[str]) -> None:
    from slurm_fiber.client.fiberctl import quick_parse

    assert quick_parse(argv) is None


def test_a_forward_that_fails_names_the_signal_and_ctrl_c_escalates(capsys) -> None:
    import signal

    from slurm_fiber.client.fiberctl import Abandoned, SignalForwarder

    forwarder = SignalForwarder("/nonexistent/fiberd.sock")
    forwarder.on_signal(signal.SIGINT, None)
    forwarder.on_signal(signal.SIGINT, None)
    assert forwarder.held == [signal.SIGINT, signal.SIGKILL]
    forwarder.attach("f1")  # both forwards fail: nothing listens
    said = capsys.readouterr().err.splitlines()
    assert [line.split(":")[1] for line in said] == [" could not forward SIGINT",
                                                     " could not forward SIGKILL"]
    with pytest.raises(Abandoned):
        forwarder.on_signal(signal.SIGINT, None)


def test_the_forwarder_restores_the_handlers_it_replaced() -> None:
    import signal

    from slurm_fiber.client.fiberctl import FORWARDED_SIGNALS, SignalForwarder

    before = {signum: signal.getsignal(signum) for signum in FORWARDED_SIGNALS}
    with SignalForwarder("/nonexistent/fiberd.sock") as forwarder:
        assert all(signal.getsignal(s) == forwarder.on_signal for s in FORWARDED_SIGNALS)
    assert {signum: signal.getsignal(signum) for signum in FORWARDED_SIGNALS} == before


def argparse_outcome(argv: list[str]) -> dict[str, object] | int:
    """What fiberctl's argparse parser makes of ``argv``: the namespace, or its exit code."""
    import contextlib
    import io

    from slurm_fiber.client.fiberctl import parse

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return vars(parse(argv))
        except SystemExit as e:
            return int(e.code or 0)


def check_fast_path(argv: list[str]) -> bool:
    """The fast path (main's: hoist, then quick_parse) either means exactly what argparse
    means, or defers to it (None). True when it parsed."""
    from slurm_fiber.client.fiberctl import hoist, quick_parse

    quick = quick_parse(hoist(argv))
    if quick is not None:
        assert vars(quick) == argparse_outcome(argv), argv
    return quick is not None


@pytest.mark.parametrize(("argv", "parsed"), [
    (["run", "--", "true"], True),
    (["run"], True),  # no command: argparse's empty cmd too (run then says what to give)
    (["run", "--"], True),
    (["run", "true", "--", "x"], True),
    (["run", "--", "--", "-q"], True),  # after the first --, everything is the command's
    (["run", "true", "-q"], True),  # an option after the command: argparse takes it too
    (["run", "true", "-q", "x"], False),  # ... then a positional argparse refuses
    (["run", "--token=/t", "--", "x"], True),
    (["run", "--token", "/t", "--", "x"], True),
    (["run", "-t", "/t", "--", "x"], True),
    (["run", "--token=", "--", "x"], True),
    (["run", "--token", "--", "x"], False),  # the value missing: argparse says so
    (["run", "--token"], False),
    (["run", "-g", "a", "-g", "b", "--", "x"], True),  # repeated: the last wins
    (["run", "-e", "A=1", "--env", "B=2", "--env=C=3", "--", "x"], True),  # appended
    (["run", "-q", "--quiet", "--", "x"], True),
    (["run", "--quiet=1", "--", "x"], False),
    (["run", "--grant", "-q", "--", "x"], False),
    (["run", "--gra", "g", "--", "x"], False),  # an abbreviation: argparse's own rules
    (["run", "-gg1", "--", "x"], False),  # a short option's attached value
    (["run", "-qe", "A=1", "--", "x"], False),  # bundled short options
    (["run", "--bogus", "--", "x"], False),  # unknown option
    (["run", "-x", "--", "y"], False),
    (["run", "--all", "--", "x"], False),  # another command's option
    (["run", "-h"], False), (["run", "--help"], False),
    (["-S", "/s", "run", "--", "x"], True),  # a global option before the command
    (["--socket=/s", "-q", "run", "-g", "g", "--", "x"], True),
    (["call", "m:f"], True),
    (["call", "m:f", "[1, 2]"], True),
    (["call", "m:f", "{}", "-q"], True),
    (["call", "-g", "g", "--token=/t", "m:f", "{}"], True),
    (["call", "m:f", "--grant", "g", "{}"], False),
    (["call"], False),  # missing target
    (["call", "a", "b", "c"], False),
    (["call", "m:f", "--", "x"], False),
    (["call", "--unknown", "m:f"], False),
    ([], False), (["status"], False), (["map", "--", "x"], False), (["bogus"], False),
    (["--help"], False), (["-q"], False),
])
def test_the_fast_path_means_what_argparse_means_or_defers(argv: list[str],
                                                           parsed: bool) -> None:
    assert check_fast_path(argv) is parsed


WORDS = ["run", "call", "--", "-q", "--quiet", "-S", "/s", "--socket=/s", "-g", "g1", "--grant",
         "--grant=g2", "-t", "--token", "/tok", "--token=/t2", "-e", "A=1", "--env=B=2", "--env",
         "-x", "--json", "-h", "m:f", "[1]", "{}", "true", "a b", "-", "--gr", "-gq", "=", ""]


@given(st.lists(st.sampled_from(WORDS), max_size=8)
       | st.tuples(st.sampled_from(["run", "call"]), st.lists(st.sampled_from(WORDS), max_size=8))
       .map(lambda head_tail: [head_tail[0], *head_tail[1]]))
def test_the_fast_path_means_what_argparse_means_or_defers_for_any_words(
        argv: list[str]) -> None:
    check_fast_path(argv)
