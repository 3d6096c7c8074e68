"""Real processes racing: one holder at a time, and no state update lost."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from slurm_fiber.lease.dirlease import Dir
from slurm_fiber.lease.holder import Holder
from slurm_fiber.lease.state import Grant, Party, load, update

WORKERS = 8
ROUNDS = 500
RESOURCES = ("gpu0", "gpu1", "kind-lab")


def racer(root: str, marks: str, worker: int, out: multiprocessing.Queue) -> None:
    """Claim and release in a loop; while holding, prove no one else holds."""
    d, won, violations = Dir(root), 0, []
    for i in range(ROUNDS):
        res = RESOURCES[(i + worker) % len(RESOURCES)]
        me = Holder(env=res, holder=f"w{worker}", session=f"w{worker}@pid:{os.getpid()}",
                    purpose=f"round {i}", since="2027-01-01T00:00:00Z")
        if d.claim(res, me) is not None:
            continue
        won += 1
        try:
            fd = os.open(os.path.join(marks, res), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            violations.append(f"{res}: someone else holds it too (round {i})")
        else:
            os.close(fd)
            if d.get(res) != me:
                violations.append(f"{res}: the record is not mine (round {i})")
            os.unlink(os.path.join(marks, res))
        d.release(res)
    out.put((won, violations))


def writer(state: str, worker: int, count: int) -> None:
    for i in range(count):
        with update(Path(state)) as st:
            st.grants.append(Grant("gpu0", Party(session=f"w{worker}-{i}"), Party(), float(i)))


def test_claim_release_races_one_holder_at_a_time(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    marks = tmp_path / "marks"
    marks.mkdir()
    out: multiprocessing.Queue = ctx.Queue()
    procs = [ctx.Process(target=racer, args=(str(tmp_path / "leases"), str(marks), w, out))
             for w in range(WORKERS)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert [v for _, vs in results for v in vs] == []
    assert all(won > 0 for won, _ in results), results
    assert Dir(tmp_path / "leases").list() == []


def test_concurrent_state_writers_lose_no_grant(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    state = tmp_path / "state.json"
    procs = [ctx.Process(target=writer, args=(str(state), w, 20)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    sessions = sorted(g.to.session for g in load(state).grants)
    assert sessions == sorted(f"w{w}-{i}" for w in range(WORKERS) for i in range(20))
