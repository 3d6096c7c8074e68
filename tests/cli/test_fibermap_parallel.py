"""``fiberctl map`` beside GNU parallel on the same inputs (issue 39, 2 and 3).

Each test runs GNU parallel (/usr/bin/parallel; skipped where it is not installed) and
the venv's ``fiberctl map`` against a real standalone fiberd on the same command and
inputs, and compares what a user sees: the output lines (in order with ``-k``), the
joblog's rows (each task's own start and run time), the exit status, and what an
unsupported option does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.cli.throwaway import Site
from tests.executor.sitekit import started_site, stop_site

FIBERCTL = str(Path(sys.executable).parent / "fiberctl")
PARALLEL = shutil.which("parallel")
pytestmark = pytest.mark.skipif(PARALLEL is None, reason="GNU parallel is not installed")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    s = started_site(tmp_path_factory.mktemp("site"))
    yield s
    stop_site(s)


def env() -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "SHELL": "/bin/sh",
            "LC_ALL": "C.UTF-8"}


def fmap(site: Site, *args: str, stdin: str = "", cwd: Path | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FIBERCTL, "map", "-S", str(site.socket), *args], input=stdin,
                          capture_output=True, text=True, timeout=120, env=env(), cwd=cwd)


def gnu(*args: str, stdin: str = "", cwd: Path | None = None
        ) -> subprocess.CompletedProcess[str]:
    assert PARALLEL is not None
    return subprocess.run([PARALLEL, "--will-cite", *args], input=stdin, capture_output=True,
                          text=True, timeout=120, env=env(), cwd=cwd)


def rows(path: Path) -> dict[int, list[str]]:
    return {int(r[0]): r for r in (line.split("\t")
                                   for line in path.read_text().splitlines()[1:])}


def test_each_joblog_row_counts_its_own_tasks_start_and_run_time(site: Site,
                                                                  tmp_path: Path) -> None:
    # -j2 over tasks of known length: 3 starts when 1 ends, 4 when 2 ends (0.5 s, 1.0 s)
    lengths = "0.5\n1.0\n1.5\n2.0\n"
    ours, theirs = tmp_path / "ours.log", tmp_path / "theirs.log"
    assert fmap(site, "-j2", "--joblog", str(ours), "--", "sleep", "{}",
                stdin=lengths).returncode == 0
    assert gnu("-j2", "--joblog", str(theirs), "sleep", "{}", stdin=lengths).returncode == 0
    mine, gnus = rows(ours), rows(theirs)
    assert sorted(mine) == sorted(gnus) == [1, 2, 3, 4]
    first_mine = min(float(r[2]) for r in mine.values())
    first_gnu = min(float(r[2]) for r in gnus.values())
    for seq in mine:
        runtime, gnu_runtime = float(mine[seq][3]), float(gnus[seq][3])
        assert abs(runtime - gnu_runtime) < 0.3, (seq, mine[seq], gnus[seq])
        offset = float(mine[seq][2]) - first_mine  # when it started, from the first start
        gnu_offset = float(gnus[seq][2]) - first_gnu
        assert abs(offset - gnu_offset) < 0.3, (seq, mine[seq], gnus[seq])
    assert len({mine[seq][2] for seq in mine}) >= 3  # not one start shared by a batch


def same_output(site: Site, args: list[str], stdin: str = "", cwd: Path | None = None,
                ordered: bool = True) -> subprocess.CompletedProcess[str]:
    """Run both on ``args``; assert the same exit status and stdout (as a multiset unless
    ``ordered``); fiberctl map's result."""
    ours, theirs = fmap(site, *args, stdin=stdin, cwd=cwd), gnu(*args, stdin=stdin, cwd=cwd)
    assert ours.returncode == theirs.returncode, (args, ours.stderr, theirs.stderr)
    got, want = ours.stdout.splitlines(), theirs.stdout.splitlines()
    assert (got if ordered else sorted(got)) == (want if ordered else sorted(want)), args
    return ours


@pytest.mark.parametrize("args", [
    ["echo", ":::", "a", "b", "c"],                       # no --: the command, then :::
    ["--", "echo", ":::", "a", "b", "c"],                 # the issue's own words
    ["-k", "echo", "{}", ":::", "a", "b", ":::", "1", "2"],  # every combination, in order
    ["-k", "echo", "{2}", "{1}", ":::", "a", "b", ":::+", "1", "2", "3"],  # linked
    ["-k", "--colsep", ",", "echo", "{2}-{1}", ":::", "x,y", "p,q"],
    ["-k", "--tag", "echo", ":::", "a", "b", ":::", "1", "2"],
    ["-k", "echo {} | tr a-z A-Z", ":::", "ab", "cd"],  # one word: a shell line
    ["-k", "echo {1}/{2.}", ":::", "a b", ":::", "c.txt"],  # quoted in the shell line
    ["-k", "-j3", "sleep {}; echo {}", ":::", "0.6", "0.3", "0.1"],  # -k: input order
    ["-j2", "exit {}", ":::", "0", "1", "2", "3"],          # exit status: tasks failed
    ["-k", "echo", "{#}", "{/}", "{//}", "{/.}", ":::", "/d/x.tar.gz", "y"],
])
def test_map_prints_what_gnu_parallel_prints(site: Site, args: list[str]) -> None:
    same_output(site, args, ordered="-k" in args)


def test_input_files_and_stdin_as_parallel_reads_them(site: Site, tmp_path: Path) -> None:
    (tmp_path / "f1").write_text("a\nb\n")
    (tmp_path / "f2").write_text("1\n2\n")
    same_output(site, ["-k", "-a", "f1", "-a", "f2", "echo"], cwd=tmp_path)
    same_output(site, ["-k", "echo", "::::", "f1", "::::+", "f2"],
                cwd=tmp_path)
    same_output(site, ["-k", "echo", "{#}", "{}"], stdin="x y\nz\n")
    same_output(site, ["-k", "--colsep", " ", "echo", "{2}"], stdin="p q\nr s\n")


def test_dry_run_prints_the_commands_as_parallel_does(site: Site) -> None:
    out = same_output(site, ["--dry-run", "-k", "echo", "{}", ":::", "a b", "c'd", "e"])
    assert out.stdout.splitlines() == ["echo 'a b'", "echo 'c'\"'\"'d'", "echo e"]
    same_output(site, ["--dry-run", "echo {} | wc -c", ":::", "a b"])


def test_resume_and_resume_failed_skip_what_the_joblog_says(site: Site,
                                                              tmp_path: Path) -> None:
    first = ["exit {}", ":::", "0", "1", "0", "1"]
    again = ["-k", "echo {#}", ":::", "0", "1", "0", "1", "5"]
    for flag in ("--resume", "--resume-failed"):
        seen = {}
        for who in ("ours", "gnu"):
            log = tmp_path / f"{who}{flag}.log"
            logged = ["--joblog", str(log)]
            if who == "ours":
                fmap(site, *logged, *first)
                out = fmap(site, *logged, flag, *again)
            else:
                gnu(*logged, *first)
                out = gnu(*logged, flag, *again)
            seen[who] = (out.stdout.splitlines(), out.returncode, sorted(rows_all(log)))
        assert seen["ours"] == seen["gnu"], (flag, seen)


def rows_all(path: Path) -> list[int]:
    """Every logged sequence number, repeats kept (a resumed log appends)."""
    return [int(line.split("\t")[0]) for line in path.read_text().splitlines()[1:]]


def test_results_dir_holds_each_combination_as_parallel_lays_it_out(
        site: Site, tmp_path: Path) -> None:
    fmap(site, "--results", str(tmp_path / "ours"), "echo", ":::", "a", "b/c", ":::", "1")
    gnu("--results", str(tmp_path / "gnu"), "echo", ":::", "a", "b/c", ":::", "1")
    ours = sorted(str(p.relative_to(tmp_path / "ours")) for p in (tmp_path / "ours").rglob("*"))
    theirs = sorted(str(p.relative_to(tmp_path / "gnu")) for p in (tmp_path / "gnu").rglob("*"))
    assert ours == theirs
    assert (tmp_path / "ours/1/b\\_c/2/1/stdout").read_text() == "b/c 1\n"


@pytest.mark.parametrize("option", ["--pipe", "-X", "--null", "-u", "--sshlogin", "-N",
                                    "--line-buffer", "--shuf", "-m"])
def test_an_option_map_does_not_have_exits_2_with_one_line_naming_it(
        site: Site, option: str) -> None:
    out = fmap(site, option, "echo", ":::", "a")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and option in out.stderr, out.stderr


def test_progress_goes_to_stderr_and_leaves_stdout_as_it_was(site: Site) -> None:
    plain = fmap(site, "-k", "echo", ":::", "a", "b", "c")
    for flag, mark in (("--eta", "ETA:"), ("--bar", "3/3"), ("--progress", "local:")):
        shown = fmap(site, flag, "-k", "echo", ":::", "a", "b", "c")
        assert shown.stdout == plain.stdout and mark in shown.stderr, (flag, shown.stderr)
