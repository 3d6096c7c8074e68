"""How a template learns its children's exits (core/child_exits.py): SIGCHLD's records
name the exited child; records of exits that came while one was unread are lost (the
kernel coalesces them), and a walk of all children, allowed by ``sweep_due``, finds
those. The signalfd runs in a child process: blocking SIGCHLD must not touch pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from slurm_fiber.core.templates.child.child_exits import (
    SWEEP_MAX_WAIT,
    SWEEP_SPACING,
    sweep_due,
    sweep_wait,
)


def test_a_walk_is_due_only_after_a_sigchld_and_spaced_by_what_the_last_one_took() -> None:
    took = 0.001
    later = 1.0 + SWEEP_SPACING * took
    assert not sweep_due(False, 100.0, 1.0, took)  # nothing came: never
    assert not sweep_due(True, later - 0.0001, 1.0, took)
    assert sweep_due(True, later, 1.0, took)
    assert sweep_due(True, 1.0, 1.0, 0.0)  # a walk of no children: always
    assert sweep_wait(False, 1.0, 1.0, took) is None  # nothing owed: poll forever
    assert sweep_wait(True, 1.0, 1.0, took) == pytest.approx(SWEEP_SPACING * took)
    assert sweep_wait(True, later + 5, 1.0, took) == 0.0
    # A walk that looked for long (thousands of children) spaces the next by at most
    # SWEEP_MAX_WAIT: an exit whose SIGCHLD coalesced is never left for longer.
    assert sweep_due(True, 1.0 + SWEEP_MAX_WAIT, 1.0, 5.0)
    assert sweep_wait(True, 1.0, 1.0, 5.0) == pytest.approx(SWEEP_MAX_WAIT)


CHILD = textwrap.dedent("""
    import json, os, select, signal, time
    from slurm_fiber.core.templates.child.child_exits import ChildExits
    exits = ChildExits()
    blocked = signal.SIGCHLD in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    go_r, go_w = os.pipe()
    kids = []
    for _ in range(20):
        pid = os.fork()
        if pid == 0:
            os.read(go_r, 1)
            os._exit(7)
        kids.append(pid)
    os.write(go_w, b"x" * 20)  # all exit together, with nobody reading the signalfd
    deadline = time.monotonic() + 10
    while sum(os.waitid(os.P_PID, k, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
              for k in kids) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    select.select([exits], [], [], 10)
    named = exits.pids()
    for pid in named:
        assert os.waitpid(pid, 0)[1] >> 8 == 7
    walked = []
    try:
        while (found := os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG)) is not None:
            walked.append(found.si_pid)
    except ChildProcessError:  # all reaped
        pass
    print(json.dumps({"blocked": blocked, "kids": kids, "named": named, "walked": walked,
                      "again": exits.pids()}))
""")


def test_records_name_exited_children_and_coalesced_ones_are_found_by_a_walk() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["blocked"] is True
    # Twenty exits while none was read: the kernel kept one record, not twenty.
    assert 1 <= len(seen["named"]) < 20
    assert set(seen["named"]) <= set(seen["kids"])
    assert sorted(seen["named"] + seen["walked"]) == sorted(seen["kids"])
    assert seen["again"] == []  # reaping sends no record of its own
