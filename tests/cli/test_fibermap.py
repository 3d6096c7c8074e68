"""``fiberctl map`` and ``fiberctl wait`` as a job script runs them: the venv's ``fiberctl``
as a subprocess, against a real standalone fiberd (tests/executor/sitekit.py).

Must show (issue 14): placeholders, GNU parallel's joblog format, --halt, --retries,
the exit status, the results dir, progress only on a terminal; also --tag, --call,
--timeout, --json, the argument sources, and wait."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.cli.throwaway import Site
from tests.executor.sitekit import started_site, stop_site

FIBERCTL = str(Path(sys.executable).parent / "fiberctl")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    s = started_site(tmp_path_factory.mktemp("site"))
    yield s
    stop_site(s)


def fmap(site: Site, *args: str, stdin: str = "",
         stderr: int = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run([FIBERCTL, "map", "-S", str(site.socket), *args], input=stdin,
                          stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=120,
                          env=env)


def joblog(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def test_placeholders_are_filled_per_word_without_a_shell(site: Site) -> None:
    out = fmap(site, "-j1", "--", "echo", "{}", "[{#}]", "{.}", "{/}", "{//}", "{/.}", "{%}",
               stdin="/data/in/a.txt\nb c\n")
    assert out.returncode == 0, out.stderr
    #                                  {}          {#}  {.}        {/}   {//}     {/.} {%}
    assert out.stdout.splitlines() == ["/data/in/a.txt [1] /data/in/a a.txt /data/in a 1",
                                       "b c [2] b c b c . b c 1"]
    appended = fmap(site, "--range", "3-4", "-j1", "--", "echo", "n=")
    assert appended.stdout.splitlines() == ["n= 3", "n= 4"]  # no placeholder: appended


def test_the_joblog_is_gnu_parallels_and_the_exit_status_counts_failures(
        site: Site, tmp_path: Path) -> None:
    log = tmp_path / "joblog"
    out = fmap(site, "-j2", "--joblog", str(log), "--", "sh", "-c", "echo out{}; exit {}",
               stdin="0\n3\n0\n4\n")
    assert out.returncode == 2  # two tasks failed
    rows = joblog(log)
    assert rows[0] == ["Seq", "Host", "Starttime", "JobRuntime", "Send", "Receive",
                       "Exitval", "Signal", "Command"]
    by_seq = {int(r[0]): r for r in rows[1:]}
    assert sorted(by_seq) == [1, 2, 3, 4]
    seq2 = by_seq[2]
    assert seq2[1] == ":" and float(seq2[2]) > 1.7e9 and float(seq2[3]) >= 0
    assert seq2[3] == f"{float(seq2[3]):10.3f}" and len(seq2[2].split(".")[1]) == 3
    assert seq2[4:8] == ["0", "5", "3", "0"]  # Send, Receive (bytes of "out3\n"), Exitval
    assert seq2[8] == "sh -c 'echo out3; exit 3'"  # as a shell would take it back
    many = fmap(site, "--range", "1-103", "-j2", "--", "false")
    assert many.returncode == 101  # more than 100 failed


def test_halt_now_fail_stops_running_fibers_and_exits_with_the_failing_status(
        site: Site, tmp_path: Path) -> None:
    log = tmp_path / "joblog"
    out = fmap(site, "-j2", "--halt", "now,fail=1", "--joblog", str(log), "--",
               "sh", "-c", "if [ {} = fail ]; then exit 7; fi; sleep {}",
               stdin="30\nfail\n1\n1\n1\n")
    assert out.returncode == 7
    rows = joblog(log)[1:]
    assert len(rows) == 2  # the failing task and the one it stopped; no new one started
    stopped = next(r for r in rows if r[0] == "1")
    assert stopped[8] == "sh -c 'if [ 30 = fail ]; then exit 7; fi; sleep 30'"
    assert stopped[6] == "-1" and stopped[7] in ("15", "9")
    soon = fmap(site, "-j1", "--halt", "soon,fail=2", "--", "sh", "-c", "exit {}",
                stdin="1\n0\n1\n1\n1\n")
    assert soon.returncode == 2  # stopped after the second failure: 2 failed
    percent = fmap(site, "-j1", "--halt", "soon,fail=50%", "--", "sh", "-c", "exit {}",
                   stdin="0\n1\n1\n0\n")
    assert percent.returncode == 67  # halted at 2 of 4 failed; 2 of the 3 run: 67%


def test_retries_run_a_failing_task_again_and_log_the_last_try(site: Site,
                                                               tmp_path: Path) -> None:
    counter, log = tmp_path / "tries", tmp_path / "joblog"
    script = f"echo x >> {counter}; [ $(wc -l < {counter}) -ge 3 ]"
    out = fmap(site, "--retries", "3", "--joblog", str(log), "--", "sh", "-c", script,
               stdin="only\n")
    assert out.returncode == 0, out.stderr
    assert len(counter.read_text().splitlines()) == 3
    assert len(joblog(log)) == 2 and joblog(log)[1][6] == "0"
    counter.unlink()
    capped = fmap(site, "--retries", "2", "--", "sh", "-c", script, stdin="only\n")
    assert capped.returncode == 1 and len(counter.read_text().splitlines()) == 2


def test_results_dir_and_tag(site: Site, tmp_path: Path) -> None:
    res = tmp_path / "res"
    out = fmap(site, "--tag", "--results", str(res), "--", "sh", "-c",
               "echo one {}; echo two; echo oops >&2", stdin="a b\nx/y\n")
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["a b\tone a b", "a b\ttwo", "x/y\tone x/y",
                                               "x/y\ttwo"]
    assert sorted(out.stderr.splitlines()) == ["a b\toops", "x/y\toops"]
    place = res / "1" / "a b"
    # as GNU parallel's: the files hold the task's own output, --tag marks only what prints
    assert (place / "stdout").read_text() == "one a b\ntwo\n"
    assert (place / "stderr").read_text() == "oops\n"
    assert (place / "seq").read_text() == "1\n"
    assert (res / "1" / "x\\_y" / "seq").read_text() == "2\n"


def test_call_mode_prints_each_result_and_counts_a_raise_as_failed(site: Site) -> None:
    out = fmap(site, "-j2", "--call", "tests.executor.fnkit:echo_and_fail", "--tag", "--json",
               stdin="good\nbad\n")
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    summary = json.loads(lines[-1])
    assert (summary["tasks"], summary["succeeded"], summary["failed"]) == (2, 1, 1)
    assert sorted(lines[:-1]) == ['bad\tprinted bad', 'good\t"good"', "good\tprinted good"]
    assert "bad\tValueError: no bad" in out.stderr
    words = fmap(site, "--range", "5-5", "--call", "tests.executor.fnkit:describe", "--",
                 "{#}", "x{}")
    assert json.loads(words.stdout)[:2] == [["1", "x5"], {}]


def test_timeout_stops_the_task_and_logs_it_as_killed(site: Site, tmp_path: Path) -> None:
    log = tmp_path / "joblog"
    out = fmap(site, "--timeout", "1", "--joblog", str(log), "--", "sleep", stdin="60\n0\n")
    assert out.returncode == 1
    by_cmd = {r[8]: r for r in joblog(log)[1:]}
    assert set(by_cmd) == {"sleep 60", "sleep 0"}
    assert by_cmd["sleep 60"][6:8] in (["-1", "15"], ["-1", "9"])
    assert by_cmd["sleep 0"][6:8] == ["0", "0"]


def test_arguments_from_a_file_and_a_range(site: Site, tmp_path: Path) -> None:
    args = tmp_path / "args"
    args.write_text("p\nq\n")
    assert sorted(fmap(site, "-a", str(args), "--", "echo").stdout.split()) == ["p", "q"]
    assert sorted(fmap(site, "--range", "3-1", "--", "echo").stdout.split()) == ["1", "2", "3"]


def test_progress_is_drawn_only_when_stderr_is_a_terminal(site: Site) -> None:
    piped = fmap(site, "--range", "1-3", "--", "true")
    assert piped.returncode == 0 and piped.stderr == ""
    leader, follower = pty.openpty()
    try:
        done = fmap(site, "--range", "1-3", "--", "true", stderr=follower)
        os.close(follower)
        follower = -1
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)
    assert done.returncode == 0
    assert b"3/3" in seen and b"0 failed" in seen


def test_a_final_miss_stops_the_map_with_fiberctls_code(site: Site) -> None:
    out = fmap(site, "--grant", "no-such-grant", "--range", "1-5", "--", "true")
    assert out.returncode == 77
    assert out.stderr.strip().startswith("unknown_grant:")


def test_usage_errors_exit_2(site: Site) -> None:
    assert fmap(site, "--range", "1-2").returncode == 2  # no command, no --call
    assert fmap(site, "--halt", "sometimes", "--", "true").returncode == 2


def test_wait_returns_once_ready_and_says_why_it_gave_up(site: Site, tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"]}
    ready = subprocess.run([FIBERCTL, "wait", "-S", str(site.socket), "--timeout", "10"],
                           capture_output=True, text=True, timeout=60, env=env)
    assert ready.returncode == 0, ready.stderr
    nobody = subprocess.run([FIBERCTL, "wait", "-S", str(tmp_path / "none.sock"),
                             "--timeout", "0.3"], capture_output=True, text=True, timeout=60,
                            env=env)
    assert nobody.returncode == 69 and "not ready after 0.3 s" in nobody.stderr
    no_grant = subprocess.run([FIBERCTL, "wait", "-S", str(site.socket), "--grant", "other",
                               "--timeout", "0.3"], capture_output=True, text=True,
                              timeout=60, env=env)
    assert no_grant.returncode == 75 and "'other'" in no_grant.stderr


def test_ctrl_c_stops_the_running_fibers_and_exits_130(site: Site) -> None:
    env = {"PATH": os.environ["PATH"]}
    proc = subprocess.Popen([FIBERCTL, "map", "-S", str(site.socket), "-j2", "--", "sleep"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None
    before = len(site.audit_path.read_text().splitlines())
    proc.stdin.write("30\n31\n32\n")
    proc.stdin.close()

    def running() -> list[dict[str, object]]:
        return [f for f in site.request("list_fibers")["fibers"]
                if f.get("state") == "running"]

    while len(running()) < 2:
        assert proc.poll() is None, proc.stderr.read()  # type: ignore[union-attr]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    err = proc.stderr.read()  # type: ignore[union-attr]
    assert "interrupted; running fibers were stopped" in err
    assert running() == []  # stopped before fiberctl exited, not left to fiberd's hang-up
    records = [json.loads(line) for line in site.audit_path.read_text().splitlines()[before:]]
    assert len([r for r in records if r["event"] == "clone"]) == 2  # the third never started


def test_a_map_keeps_j_tasks_running_through_windowed_batches(site: Site,
                                                              tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    before = len(site.audit_path.read_text().splitlines())
    out = fmap(site, "-j3", "--range", "1-100", "--", "sh", "-c",
               f'echo "+{{}}" >> {marks}; sleep 0.0{{}}; echo "-{{}}" >> {marks}')
    assert out.returncode == 0, out.stderr
    running = most = 0
    for mark in marks.read_text().split():
        running += 1 if mark.startswith("+") else -1
        most = max(most, running)
    assert most == 3 and len(marks.read_text().split()) == 200
    records = [json.loads(line) for line in site.audit_path.read_text().splitlines()[before:]]
    batches = [r["batch"] for r in records if r["event"] == "clone"]
    assert sorted(set(batches)) == [36, 64]  # one worker: 64 tasks a request, then the rest


def test_slots_beyond_the_cpus_start_as_batch_clones_each_audited(site: Site,
                                                                  tmp_path: Path) -> None:
    """With ``{%}`` (a slot only the client can number), each worker's share of the slots
    starts as one batch."""
    log = tmp_path / "joblog"
    before = len(site.audit_path.read_text().splitlines())
    out = fmap(site, "-j6", "--range", "1-12", "--joblog", str(log), "--retries", "2", "--",
               "sh", "-c", "echo {}:{%}; [ {} != 5 ] || [ -e " + str(tmp_path / "again")
               + " ] || { touch " + str(tmp_path / "again") + "; exit 3; }")
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.split())
    assert len(lines) == 12 and {int(x.split(":")[0]) for x in lines} == set(range(1, 13))
    assert {int(x.split(":")[1]) for x in lines} <= set(range(1, 7))
    assert len(joblog(log)) == 13 and all(row[6] == "0" for row in joblog(log)[1:])
    records = [json.loads(line) for line in
               site.audit_path.read_text().splitlines()[before:]]
    clones = [r for r in records if r["event"] == "clone"]
    assert len(clones) == 13  # twelve tasks, one of them tried twice: each its own record
    assert len({r["fiber"] for r in clones}) == 13
    from slurm_fiber.client.fibermap import worker_slots

    biggest = max(n for _, n in worker_slots(6, len(os.sched_getaffinity(0))))
    assert max(r.get("batch", 1) for r in clones) == biggest  # on 2 CPUs: 2 workers of 3


def test_worker_slots_share_the_jobs_out() -> None:
    from slurm_fiber.client.fibermap import window_slots, worker_slots

    assert worker_slots(2, 2) == [(1, 1), (2, 1)]
    assert worker_slots(5, 2) == [(1, 3), (4, 2)]
    assert worker_slots(1, 8) == [(1, 1)]
    assert window_slots(2) == [(1, 2)]
    assert window_slots(70) == [(1, 32), (33, 32), (65, 6)]


def test_nodes_all_outside_a_multi_node_job_says_so_and_runs_here(site: Site,
                                                                  tmp_path: Path) -> None:
    out = fmap(site, "--nodes", "all", "-j2", "--range", "1-3", "--joblog",
               str(tmp_path / "log"), "--", "echo", "{}")
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split()) == ["1", "2", "3"]
    assert out.stderr.splitlines() == ["fiberctl map: --nodes all: not in a Slurm job of "
                                       "several nodes; running every task on this node"]
    assert [row[1] for row in joblog(tmp_path / "log")[1:]] == [":", ":", ":"]


@pytest.mark.parametrize("columns", [60, 120])
def test_the_help_is_wrapped_to_the_terminals_width(columns: int) -> None:
    out = subprocess.run([sys.executable, "-c",
                          "from slurm_fiber.client.fiberctl import main; main()", "map", "--help"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "COLUMNS": str(columns)})
    options = out.stdout[out.stdout.index("options:"):].splitlines()
    assert max(len(line) for line in options) <= columns - 2
    assert max(len(line) for line in options) > columns - 20


SCORE = """#!/bin/sh
if [ $# -gt 0 ]; then echo "score $1"; else read -r line; echo "score $line"; fi
"""


def test_the_readme_map_example_runs_verbatim(site: Site, tmp_path: Path) -> None:
    import re

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = next(b for b in re.findall(r"```sh\n(.*?)```", readme, re.S)
                 if "fiberctl map" in b)
    (tmp_path / "score.sh").write_text(SCORE)
    (tmp_path / "score.sh").chmod(0o755)
    (tmp_path / "inputs.txt").write_text("x\ny\n")
    (tmp_path / "ids.txt").write_text("3\n4\n")
    (tmp_path / "sim.py").write_text("import sys\nprint('seed', sys.argv[2])\n")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "tasks.py").write_text("def score(x):\n    return int(x) ** 2\n")
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
           "HOME": os.environ.get("HOME", "/root"), "FIBERD_SOCKET": str(site.socket)}
    out = subprocess.run(["/bin/sh", "-ec", block], cwd=tmp_path, env=env, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sorted(lines[:2]) == ["score x", "score y"]
    assert lines[2:6] == ["score a-1", "score a-2", "score b-1", "score b-2"]
    assert sorted(lines[6:106]) == sorted(f"seed {i}" for i in range(1, 101))
    assert sorted(lines[106:]) == ["3\t9", "4\t16"]  # --tag: the argument, a TAB, JSON
    assert (tmp_path / "out" / "1" / "4" / "stdout").read_text() == "16\n"
