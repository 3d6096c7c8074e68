"""Output and history (issue 39, 5): ``fiberctl logs ID [--follow]`` reads a fiber's output
from fiberd's files; an ended fiber stays visible to ``inspect`` and ``ls --all`` within
fiberd's ``history`` bounds; ``--json`` on run, call, wait and logs; times for people as
ISO 8601 with a relative age (``--json`` keeps numbers). Against real standalone fiberds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.cli.throwaway import Site
from slurm_fiber.client.connection import FiberdClient
from tests.executor.sitekit import PRELOADS, stop_site

FIBERCTL = str(Path(sys.executable).parent / "fiberctl")
ISO_AGE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \((\d+ (s|min|h|d) ago|in \d+ .*)\)")


class SmallHistory(Site):
    """A site whose fiberd remembers its last 2 ended fibers."""

    def flags(self, cgroup_root: str) -> list[str]:
        return [*super().flags(cgroup_root), "--history=2"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    s = SmallHistory.create(tmp_path_factory.mktemp("site"), PRELOADS)
    s.start(cgroup_root="delegate")
    s.wait_warm(60, lambda _state, _s: None)
    yield s
    stop_site(s)


def fiberctl(site: Site, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FIBERCTL, *args[:1], "-S", str(site.socket), *args[1:]],
                          capture_output=True, text=True, timeout=60, **kw)  # type: ignore[call-overload]


def unattended(site: Site, script: str, ended: bool = False) -> str:
    """A fiber started with no descriptors passed (its output goes to fiberd's files);
    with ``ended``, once it has ended."""
    with FiberdClient(site.socket) as client:
        fid = client.clone(exec={"argv": ["sh", "-c", script], "cwd": "/"}, wait=ended).id
        if ended:
            client.wait_exit()
        return fid


def test_logs_follows_a_fibers_output_and_reads_it_after_its_end(site: Site) -> None:
    fid = unattended(site, "echo out; echo err >&2; sleep 1; echo late")
    follow = fiberctl(site, "logs", fid, "--follow")
    assert follow.returncode == 0, follow.stderr
    assert (follow.stdout, follow.stderr) == ("out\nlate\n", "err\n")
    again = fiberctl(site, "logs", fid, "--json")  # ended: still found
    assert json.loads(again.stdout) == {"fiber": fid, "stdout": "out\nlate\n",
                                        "stderr": "err\n"}
    nobody = fiberctl(site, "logs", "no-such-1")
    assert nobody.returncode == 1 and "no-such-1" in nobody.stderr


def test_ended_fibers_stay_visible_within_the_history_bound(site: Site) -> None:
    ids = [unattended(site, f"exit {n}", ended=True) for n in (3, 4, 5)]  # one by one
    running = fiberctl(site, "ls").stdout
    assert not any(fid in running for fid in ids)  # ls: running fibers only
    listed = json.loads(fiberctl(site, "ls", "--all", "--json").stdout)
    seen = {r["id"]: r["exit"]["exit_code"] for r in listed if r["id"] in ids}
    # history=2: two are remembered (the last, surely), with how they ended; one is not
    assert len(seen) == 2 and seen[ids[2]] == 5, seen
    assert all(seen[fid] == 3 + ids.index(fid) for fid in seen), seen
    forgotten = next(fid for fid in ids if fid not in seen)
    assert fiberctl(site, "inspect", forgotten).returncode == 1
    shown = fiberctl(site, "inspect", ids[2])
    assert shown.returncode == 0, shown.stderr
    started = next(line for line in shown.stdout.splitlines() if line.startswith("started:"))
    assert ISO_AGE.search(started), started
    raw = json.loads(fiberctl(site, "inspect", ids[2], "--json").stdout)
    assert isinstance(raw["started"], float)  # --json keeps the number
    table = fiberctl(site, "ls", "--all").stdout
    assert re.search(rf"{ids[2]}\s.*exited\s+5\s+\d+ s ago", table), table


def test_json_on_run_call_wait_and_iso_times_for_grants(site: Site) -> None:
    run = fiberctl(site, "run", "--json", "--", "sh", "-c", "echo hi; exit 3")
    assert run.returncode == 3
    out, last = run.stdout.splitlines()[:-1], json.loads(run.stdout.splitlines()[-1])
    assert out == ["hi"] and last["status"] == 3 and last["exit_code"] == 3
    call = fiberctl(site, "call", "--json", "json:dumps", "[[1]]")
    assert call.returncode == 0 and json.loads(call.stdout)["result"] == "[1]"
    wait = fiberctl(site, "wait", "--json", "--timeout", "10")
    assert wait.returncode == 0 and json.loads(wait.stdout)["ready"] is True
    grants = fiberctl(site, "grants").stdout.splitlines()
    assert ISO_AGE.search(grants[1]) and "in " in grants[1], grants
    assert isinstance(json.loads(fiberctl(site, "grants", "--json").stdout)[0]["lease_end"],
                      float)
