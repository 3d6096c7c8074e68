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
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
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
