"""Waiting like srun (issue 39, 4): ``fiberctl run``/``call``/``map`` and the Executor wait
through retryable misses (a fiberd not listening yet in a job, ``cold``, ``capacity``) up
to a bound, saying once on stderr what they wait for; ``--no-wait`` and final misses exit
at once. Against real standalone fiberds: one started only after the client, with a
template that warms for 2 s, and one whose grant runs one fiber at a time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber import Executor
from slurm_fiber.cli.throwaway import Site
from slurm_fiber.core.trust.grant import Limits
from tests.executor import fnkit
from tests.executor.sitekit import PRELOADS, started_site, stop_site

FIBERCTL = str(Path(sys.executable).parent / "fiberctl")


def env_for(site: Site, **extra: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
            "FIBERD_SOCKET": str(site.socket), **extra}


def waiting_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "waiting up to" in line]


@pytest.fixture
def one_at_a_time(tmp_path: Path) -> Iterator[Site]:
    site = started_site(tmp_path / "site", Limits(fibers=1))
    yield site
    stop_site(site)


def test_run_in_a_job_waits_for_fiberd_to_listen_and_its_template_to_warm(
        tmp_path: Path) -> None:
    site = Site.create(tmp_path / "site", (*PRELOADS, "tests.cli.slowwarmkit"))
    client = subprocess.Popen([FIBERCTL, "run", "--", "echo", "hi"], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env_for(site, SLURM_JOB_ID="4242"))
    try:
        time.sleep(0.5)  # the job's fiberd starts after the client, as in a job script
        assert client.poll() is None, client.communicate()
        site.start(cgroup_root="delegate")
        out, err = client.communicate(timeout=120)
        assert (client.returncode, out) == (0, "hi\n"), err
        assert len(waiting_lines(err)) == 1, err  # said once, whatever it waited through
    finally:
        client.kill()
        stop_site(site)


def test_capacity_is_waited_through_by_run_call_map_and_the_executor(
        one_at_a_time: Site) -> None:
    site = one_at_a_time
    holder = subprocess.Popen([FIBERCTL, "run", "--", "sleep", "3"], env=env_for(site))
    try:
        time.sleep(0.5)
        at_once = subprocess.run([FIBERCTL, "call", "--no-wait", "json:dumps", "[1]"],
                                 env=env_for(site), capture_output=True, text=True,
                                 timeout=60)
        assert at_once.returncode == 75 and at_once.stderr.startswith("capacity:")
        call = subprocess.run([FIBERCTL, "call", "json:dumps", "[1]"], env=env_for(site),
                              capture_output=True, text=True, timeout=60)
        assert (call.returncode, call.stdout) == (0, '"1"\n'), call.stderr
        assert len(waiting_lines(call.stderr)) == 1 and "capacity" in call.stderr
    finally:
        holder.wait(timeout=60)
    mapped = subprocess.run([FIBERCTL, "map", "-j2", "--", "sleep", "{}", ":::", "3", "3"],
                            env=env_for(site), capture_output=True, text=True, timeout=120)
    assert mapped.returncode == 0, mapped.stderr  # the second waited for the first's room
    assert len(waiting_lines(mapped.stderr)) == 1, mapped.stderr
    with Executor(socket=site.socket, max_workers=2) as ex:
        futures = [ex.submit(fnkit.sleep_then, 2.5, None, n) for n in (1, 2)]
        assert [f.result(timeout=120) for f in futures] == [1, 2]


def test_a_final_miss_exits_at_once_without_waiting(one_at_a_time: Site) -> None:
    out = subprocess.run([FIBERCTL, "run", "--grant", "nosuch", "--", "true"],
                         env=env_for(one_at_a_time, SLURM_JOB_ID="1"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 77 and out.stderr.startswith("unknown_grant"), out.stderr
    assert waiting_lines(out.stderr) == []
