"""The claim/grant/release flow over a real lease dir and state document, on a FakeClock."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.lease.errors import LeaseError
from slurm_fiber.lease.leases import Caller, Leases
from slurm_fiber.lease.rules import Refusal
from slurm_fiber.lease.stale import process_ref
from slurm_fiber.lease.state import Party

HOST = "node1"
PROLOG = Caller(Party(session="slurm-prolog", host=HOST))


def job(n: int) -> Caller:
    return Caller(Party(session=f"slurm-job-{n}", person="ann", host=HOST),
                  process=process_ref(os.getpid()))


@pytest.fixture
def leases(tmp_path: Path, clock: FakeClock) -> Leases:
    return Leases(tmp_path / "leases", tmp_path / "state.json", clock, ttl=600, host=HOST)


def test_slurm_flow_grant_claim_release_revoke(leases: Leases, clock: FakeClock) -> None:
    leases.supervise_start(PROLOG)
    assert [leases.grant(g, job(7).party, PROLOG) for g in ("gpu0", "gpu1")] == [1, 1]
    assert leases.grant("gpu0", job(8).party, PROLOG) == 2
    with pytest.raises(Refusal) as err:
        leases.claim("gpu0", job(8), "job 8")
    assert (err.value.position, err.value.ahead) == (2, "slurm-job-7")
    held = leases.claim("gpu0", job(7), "job 7")
    assert held.party() == job(7).party and held.process() == job(7).process
    assert leases.claim("gpu0", job(7), "again") == held, "a second claim is idempotent"
    with pytest.raises(Refusal, match="is held by ann"):
        leases.claim("gpu0", job(8), "job 8")
    assert [g.to.session for g in leases.state().grants] == ["slurm-job-7", "slurm-job-8"]
    assert [g.resource for g in leases.revoke(job(7).party, PROLOG)] == ["gpu1"]
    clock.advance(3600)  # held: job 8's grant waits without expiring
    assert leases.prune() == []
    with pytest.raises(LeaseError, match="not by you"):
        leases.release("gpu0", job(8))
    assert leases.release("gpu0", job(7)) == held
    assert leases.claim("gpu0", job(8), "job 8").party() == job(8).party
    assert leases.state().grants == []


def test_grant_ttl_runs_from_release(leases: Leases, clock: FakeClock) -> None:
    leases.supervise_start(PROLOG)
    leases.grant("gpu0", job(1).party, PROLOG)
    clock.advance(601)
    assert len(leases.prune()) == 1
    with pytest.raises(Refusal, match="not a grant"):
        leases.claim("gpu0", job(1), "late")


def test_only_the_supervisor_grants(leases: Leases) -> None:
    with pytest.raises(LeaseError, match="no supervisor is recorded"):
        leases.grant("gpu0", job(1).party, PROLOG)
    leases.supervise_start(PROLOG)
    with pytest.raises(LeaseError, match="only the supervisor slurm-prolog grants"):
        leases.grant("gpu0", job(1).party, job(2))


def test_supervisor_crash_restart_window_then_successor(leases: Leases, clock: FakeClock) -> None:
    dead = subprocess.Popen(["sleep", "60"])
    sup = Caller(Party(session="sup", host=HOST), process=process_ref(dead.pid))
    leases.supervise_start(sup)
    leases.grant("gpu0", job(1).party, sup)
    dead.kill()
    dead.wait()
    with pytest.raises(Refusal, match="is restarting"):
        leases.claim("gpu1", job(2), "no grant")
    assert leases.claim("gpu0", job(1), "granted").env == "gpu0", "grants hold after a crash"
    with pytest.raises(LeaseError, match="runs since"):
        leases.supervise_start(PROLOG)
    clock.advance(leases.restart_grace)
    with pytest.raises(Refusal, match="is gone"):
        leases.claim("gpu1", job(2), "no grant")
    leases.supervise_start(PROLOG)  # the successor takes over
    leases.grant("gpu1", job(2).party, PROLOG)
    assert leases.claim("gpu1", job(2), "granted by the successor").env == "gpu1"


def test_deliberate_stop_ends_the_rule(leases: Leases) -> None:
    leases.supervise_start(PROLOG)
    with pytest.raises(LeaseError, match="not you"):
        leases.supervise_stop(job(1))
    assert leases.supervise_stop(PROLOG) is not None
    assert leases.claim("gpu0", job(1), "free again").env == "gpu0"


def test_upgrade_unblock_claim_is_recorded(leases: Leases) -> None:
    leases.supervise_start(PROLOG)
    leases.upgrade_start("kind-lab", "v2", PROLOG)
    leases.grant("kind-lab", job(1).party, PROLOG, upgrade_unblock="fix CRDs")
    with pytest.raises(Refusal, match="upgrade 'v2' runs"):
        leases.claim("kind-lab", job(2), "plain work")
    held = leases.claim("kind-lab", job(1), "unblock")
    assert held.upgrade_unblock == "fix CRDs"
    raw = json.loads((leases.dir.path / "kind-lab" / "holder.json").read_text())
    assert raw["upgradeUnblock"] == "fix CRDs"
    assert leases.upgrade_end("kind-lab") and not leases.upgrade_end("kind-lab")
