"""Issue 38, high: a job's process count and environment sizes drained the node.

mallory's job leaves 3,000 sleeping processes, each with a 1 MiB environment that
names the job (its variables last, after eight 128 KiB ones), where no cgroup holds
them (proctrack/linuxproc). They are forked, not exec'd, so they share their
environment's pages and the test costs little memory. Before the fix the epilog
read up to 1 MiB of every environment of the job's uid (and psutil for each), the
``processes`` step overran its bound and the epilog exited 1: the node drained. Now
the per-process work is fixed and small (a stat, a few KiB of /proc), the step ends
within its bound, every one of those processes is killed and the exit is 0. The
epilog runs as slurmd runs it (hookkit: the real console script, ``env -i``, root).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hooks.hookkit import ISSUER, Site, job_env, run_hook
from tests.security.publicdirkit import public_dir
from tests.security.userkit import JobUser

COUNT = 3000
JOB = 38300
FLOOD = r"""
fifo="$1/fifo"; mkfifo "$fifo"
i=0
while [ $i -lt {count} ]; do ( read x < "$fifo" ) & echo $! >> "$1/pids"; i=$((i+1)); done
echo $$ >> "$1/pids"
echo started > "$1/started"
wait
"""


@pytest.fixture
def site() -> Iterator[Site]:
    with public_dir() as scratch:
        site = Site(scratch / "site")
        site.configure("step_seconds = 2.0")  # the default bound
        yield site


def alive(pids: list[int], uid: int) -> list[int]:
    """Those of ``pids`` still running as ``uid`` (zombies left out)."""
    left = []
    for pid in pids:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat")
            if stat.parent.stat().st_uid == uid and b") Z " not in stat.read_bytes():
                left.append(pid)
    return left


def test_hostile_epilog_process_flood_never_overruns_or_drains(site: Site,
                                                             mallory: JobUser) -> None:
    env = job_env(site, JOB, mallory.uid, mallory.gid, mallory.name)
    assert run_hook("prolog", env).returncode == 0
    work = site.root.parent / "flood"
    work.mkdir(mode=0o700)
    os.chown(work, mallory.uid, mallory.gid)
    big = {f"PAD{i}": "x" * (128 * 1024 - 16) for i in range(8)}  # ~1 MiB
    marker = {"SLURM_JOB_ID": str(JOB), "SLURMD_NODENAME": "n1", "SLURM_CLUSTER_NAME": ISSUER}
    flood = subprocess.Popen(["/bin/sh", "-c", FLOOD.format(count=COUNT), "sh", str(work)],
                             **(mallory.spawn_args() | {"env": {"PATH": "/usr/bin:/bin",
                                                                **big, **marker}}))
    try:
        deadline = time.monotonic() + 120
        while not (work / "started").exists():
            assert flood.poll() is None and time.monotonic() < deadline, "the flood did not start"
            time.sleep(0.1)
        pids = [int(p) for p in (work / "pids").read_text().split()]
        assert len(alive(pids, mallory.uid)) == COUNT + 1
        out = run_hook("epilog", env | {"SLURM_SCRIPT_CONTEXT": "epilog_slurmd"}, timeout=120)
        assert "did not finish" not in out.stderr, out.stderr
        assert out.returncode == 0, out.stderr
        assert "killed" in out.stderr, out.stderr
        deadline = time.monotonic() + 30
        while alive(pids, mallory.uid):
            assert time.monotonic() < deadline, (len(alive(pids, mallory.uid)), out.stderr)
            time.sleep(0.1)
    finally:
        started = (work / "pids").read_text().split() if (work / "pids").exists() else []
        for pid in alive([int(p) for p in started], mallory.uid):  # the flood's own only
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        flood.wait(timeout=60)
