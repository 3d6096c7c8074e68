"""GPU leases on a node: the prolog grants, the job's fiberd claims, the epilog releases.

Everything runs on the real lease package over tmp dirs with a FakeClock;
the concurrent test uses real processes racing for one GPU.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock, SystemClock
from slurm_fiber.core.grant import FiberSpec, VerifiedToken
from slurm_fiber.homes.slurm.home import DevicesRefused, SlurmHome
from slurm_fiber.homes.slurm.jobenv import SlurmJob
from slurm_fiber.homes.slurm.leases import (
    NodeLeases,
    grant_job_gpus,
    job_party,
    node_leases,
    prepare_lease_area,
    release_job,
)
from slurm_fiber.homes.slurm.paths import job_paths
from slurm_fiber.homes.slurm.siteconfig import SiteConfig
from slurm_fiber.lease import LeaseError, ProcessRef

TTL = 3600.0


def job(job_id: int, gpus: tuple[int, ...]) -> SlurmJob:
    return SlurmJob(job_id=job_id, uid=os.getuid(), gid=os.getgid(), user="alice",
                    partition="debug", node="n1", cluster="citest", gpus=gpus,
                    gpu_source="SLURM_JOB_GPUS" if gpus else None)


def prolog(root: Path, j: SlurmJob, clock: FakeClock) -> list[str]:
    paths = job_paths(root, j.node, j.job_id)
    prepare_lease_area(paths)
    return grant_job_gpus(node_leases(paths, clock, TTL), j)


def fiberd(root: Path, j: SlurmJob, clock: FakeClock) -> NodeLeases:
    site = SiteConfig(state_root=root, lease_ttl=TTL)
    return NodeLeases.for_job(site, j, clock, ProcessRef(os.getpid()))


def test_the_prolog_grants_and_the_jobs_fiberd_claims(tmp_path: Path, clock: FakeClock) -> None:
    a = job(7, (0, 1))
    assert prolog(tmp_path, a, clock) == ["gpu:n1:0", "gpu:n1:1"]
    assert prolog(tmp_path, a, clock) == ["gpu:n1:0", "gpu:n1:1"]  # a rerun grants nothing new
    leases = node_leases(job_paths(tmp_path, "n1", 7), clock, TTL)
    assert [g.resource for g in leases.state().grants] == ["gpu:n1:0", "gpu:n1:1"]
    mine = fiberd(tmp_path, a, clock)
    mine.claim("gpu:n1:0")
    mine.claim("gpu:n1:0")  # idempotent
    holder = leases.dir.get("gpu:n1:0")
    assert holder is not None and holder.party().same_as(job_party(a))
    assert holder.process() == ProcessRef(os.getpid())
    assert [g.resource for g in leases.state().grants] == ["gpu:n1:1"]  # the claim used its grant
    mine.release("gpu:n1:0")
    mine.release("gpu:n1:0")  # a free one is fine
    assert leases.dir.get("gpu:n1:0") is None
    # back in the job's pool: granted to it again, so the next grant naming it claims it
    assert sorted(g.resource for g in leases.state().grants) == ["gpu:n1:0", "gpu:n1:1"]
    mine.claim("gpu:n1:0")
    assert leases.dir.get("gpu:n1:0") is not None
    mine.release("gpu:n1:0")


def test_a_gpu_not_granted_to_the_job_is_refused(tmp_path: Path, clock: FakeClock) -> None:
    prolog(tmp_path, job(7, (0,)), clock)
    other = fiberd(tmp_path, job(8, (1,)), clock)
    with pytest.raises(DevicesRefused) as err:
        other.claim("gpu:n1:1")  # job 8's prolog never granted it
    assert err.value.code == "lease_failed" and "a free lease is not a grant" in err.value.reason


def test_two_jobs_never_hold_one_gpu(tmp_path: Path, clock: FakeClock) -> None:
    a, b = job(7, (0,)), job(8, (0,))  # a misconfigured node gives both GPU 0
    prolog(tmp_path, a, clock)
    prolog(tmp_path, b, clock)
    fiberd(tmp_path, a, clock).claim("gpu:n1:0")
    with pytest.raises(DevicesRefused) as err:
        fiberd(tmp_path, b, clock).claim("gpu:n1:0")
    assert err.value.code == "device_held" and "slurm job 7" in err.value.reason
    fiberd(tmp_path, b, clock).release("gpu:n1:0")  # not b's: left alone
    leases = node_leases(job_paths(tmp_path, "n1", 7), clock, TTL)
    held = leases.dir.get("gpu:n1:0")
    assert held is not None and held.party().same_as(job_party(a))


def test_the_epilog_releases_leases_and_drops_unclaimed_grants(tmp_path: Path,
                                                               clock: FakeClock) -> None:
    a = job(7, (0, 1))
    prolog(tmp_path, a, clock)
    fiberd(tmp_path, a, clock).claim("gpu:n1:1")
    leases = node_leases(job_paths(tmp_path, "n1", 7), clock, TTL)
    assert release_job(leases, a) == (["gpu:n1:1"], ["gpu:n1:0"])
    assert leases.dir.list() == [] and leases.state().grants == []
    assert release_job(leases, a) == ([], [])  # idempotent
    assert release_job(node_leases(job_paths(tmp_path / "none", "n1", 7), clock, TTL),
                       a) == ([], [])  # a node the prolog never prepared


def test_a_claim_by_a_dead_fiberd_of_a_finished_job_is_reclaimed(tmp_path: Path,
                                                                 clock: FakeClock) -> None:
    a, b = job(7, (0,)), job(8, (0,))
    prolog(tmp_path, a, clock)
    dead = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    NodeLeases(job_paths(tmp_path, "n1", 7), a, clock, ttl=TTL,
               process=ProcessRef(dead.pid or 0)).claim("gpu:n1:0")  # then its epilog never ran
    prolog(tmp_path, b, clock)
    fiberd(tmp_path, b, clock).claim("gpu:n1:0")  # the holder is provably gone
    audit = (job_paths(tmp_path, "n1", 7).lease_dir / "audit.jsonl").read_text()
    assert '"action": "steal-stale"' in audit


def test_a_corrupt_state_document_is_a_lease_failure(tmp_path: Path, clock: FakeClock) -> None:
    a = job(7, (0,))
    paths = job_paths(tmp_path, "n1", 7)
    prepare_lease_area(paths)
    paths.lease_state.write_text("{not json")
    with pytest.raises(LeaseError, match="is not valid JSON"):
        grant_job_gpus(node_leases(paths, clock, TTL), a)
    with pytest.raises(DevicesRefused) as err:
        fiberd(tmp_path, a, clock).claim("gpu:n1:0")
    assert err.value.code == "lease_failed"


def test_the_lease_area_is_shared_with_job_users(tmp_path: Path) -> None:
    paths = job_paths(tmp_path, "n1", 7)
    prepare_lease_area(paths)
    victim = tmp_path / "victim"
    victim.write_text("x")
    victim.chmod(0o600)
    (paths.lease_dir / "audit.jsonl").unlink()
    (paths.lease_dir / "audit.jsonl").symlink_to(victim)  # planted by a job user
    prepare_lease_area(paths)
    assert victim.stat().st_mode & 0o777 == 0o600
    assert not (paths.lease_dir / "audit.jsonl").is_symlink()
    assert paths.lease_state.parent == paths.lease_dir
    assert paths.lease_dir.stat().st_mode & 0o777 == 0o777
    lock = paths.lease_state.with_name("state.json.lock")
    assert lock.stat().st_mode & 0o777 == 0o666


def _race(root: str, job_id: int, queue: multiprocessing.Queue,  # type: ignore[type-arg]
          done: object) -> None:
    j = job(job_id, (0,))
    try:
        NodeLeases(job_paths(root, "n1", job_id), j, SystemClock(), ttl=TTL,
                   process=ProcessRef(os.getpid())).claim("gpu:n1:0")
        queue.put((job_id, "claimed"))
    except DevicesRefused as err:
        queue.put((job_id, err.code))
    done.wait(30)  # type: ignore[attr-defined]  # a holder that exits would be reclaimable


def test_concurrent_claims_from_two_jobs_one_wins(tmp_path: Path) -> None:
    clock = SystemClock()
    for job_id in (7, 8):
        prolog_paths = job_paths(tmp_path, "n1", job_id)
        prepare_lease_area(prolog_paths)
        grant_job_gpus(node_leases(prolog_paths, clock, TTL), job(job_id, (0,)))
    ctx = multiprocessing.get_context("fork")
    queue, done = ctx.Queue(), ctx.Event()
    racers = [ctx.Process(target=_race, args=(str(tmp_path), j, queue, done)) for j in (7, 8)]
    for racer in racers:
        racer.start()
    outcomes = sorted(queue.get(timeout=30)[1] for _ in racers)
    done.set()
    for racer in racers:
        racer.join(30)
    assert outcomes[0] == "claimed" and outcomes[1] in {"device_held", "lease_failed"}


def grant(devices: tuple[str, ...] = ("gpu",)) -> VerifiedToken:
    return VerifiedToken(uid="g1", issuer="i", jti="j", audience=("a",), exp=2e9, iat=1e9,
                         nbf=None, spec=FiberSpec(devices=devices), raw=b"")


def test_node_leases_are_the_slurm_homes_device_leases(tmp_path: Path, clock: FakeClock) -> None:
    from slurm_fiber.homes.slurm.cgroup_root import CgroupChoice
    from slurm_fiber.homes.slurm.home import SlurmHomeConfig

    a = job(7, (1,))
    prolog(tmp_path, a, clock)
    home = SlurmHome(a, clock, control=None,  # type: ignore[arg-type]
                     config=SlurmHomeConfig(state_root=tmp_path),
                     cgroup=CgroupChoice(None, "test"), leases=fiberd(tmp_path, a, clock))
    channel, release = asyncio.run(home.devices(grant()))
    assert [d.index for d in channel.devices] == [1]
    leases = node_leases(job_paths(tmp_path, "n1", 7), clock, TTL)
    assert [h.env for h in leases.dir.list()] == ["gpu:n1:1"]
    release()
    assert leases.dir.list() == []
