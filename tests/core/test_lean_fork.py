"""LeanFork (core/lean_fork.py) in a fresh interpreter: the at-fork handlers run in
os.fork's order and places, one that raises is reported and the rest still run, the
guards a single thread does not need are left out, and a second thread, or an interpreter
other than the one it was checked against, means os.fork."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, logging, os, random, sys, threading, time
    from slurm_fiber.core.templates.child import lean_fork
    from slurm_fiber.core.templates.child.lean_fork import LeanFork

    forker = LeanFork()
    order = []
    for n in (1, 2):
        os.register_at_fork(before=lambda n=n: order.append(f"before{n}"),
                            after_in_parent=lambda n=n: order.append(f"parent{n}"),
                            after_in_child=lambda n=n: order.append(f"child{n}"))
        if n == 1:
            os.register_at_fork(after_in_child=lambda: 1 / 0)
    if sys.argv[1] == "thread":
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    if sys.argv[1] == "other":  # an interpreter the replacement was not checked against
        lean_fork.VERIFIED_ON = ("cpython", (3, 99))
    why = forker.ready()
    left = sorted(h.__qualname__ for hs in (forker.lists or {}).values() for h in hs)
    r, w = os.pipe()
    pid = forker.fork()
    if pid == 0:
        os.write(w, json.dumps([order, random.random()]).encode())
        os._exit(0)
    os.close(w)
    child, child_random = json.loads(os.read(r, 4096))
    os.waitpid(pid, 0)
    print(json.dumps({"why": why, "left": left, "parent": order, "child": child,
                      "same_random": child_random == random.random()}))
""")


def _run(mode: str) -> tuple[dict[str, object], str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout), done.stderr


def test_handlers_run_as_os_fork_runs_them():
    out, err = _run("lean")
    assert out["why"] is None
    assert out["parent"] == ["before2", "before1", "parent1", "parent2"]
    assert out["child"] == ["before2", "before1", "child1", "child2"]  # past the one that raised
    assert "Exception ignored in at-fork handler" in err and "ZeroDivisionError" in err
    assert out["same_random"] is False  # random's reseed ran in the child


def test_only_the_guards_a_single_thread_needs_not_are_left_out():
    out, _ = _run("lean")
    left = out["left"]
    assert "Random.seed" in left and left.count("<lambda>") == 7
    assert not any(name.startswith(("_after_fork", "_acquireLock", "_releaseLock",
                                    "_after_at_fork_child")) for name in left)


@pytest.mark.parametrize(("mode", "why"), [
    ("thread", "the template has 2 threads after its warm"),
    ("other", f"cpython {sys.version_info[0]}.{sys.version_info[1]} is not the cpython 3.99 "
              "whose os.fork this replaces"),
])
def test_a_second_thread_or_another_interpreter_means_os_fork(mode: str, why: str):
    out, err = _run(mode)
    assert out["why"] == why
    assert out["left"] == []  # lists unused: os.fork runs the handlers
    assert out["parent"] == ["before2", "before1", "parent1", "parent2"]
    assert out["child"] == ["before2", "before1", "child1", "child2"]
    assert "ZeroDivisionError" in err and out["same_random"] is False
