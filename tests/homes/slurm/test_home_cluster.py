"""The Slurm home's CLI backend against the real bare-host cluster.

A batch job records its own environment, the home is built from that
recording, and its health rounds ask the real slurmctld. Time logic runs on
a FakeClock; the waits here are only for the cluster to act (a job to
start, to leave the queue). Stopping slurmctld happens on a private
cluster, never on the shared one. The recording jobs run as a job user.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurm_fiber.core.book.health import HealthState
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes.slurm.control import CliControl
from slurm_fiber.homes.slurm.home import SlurmDownError, SlurmHome, SlurmHomeConfig
from slurm_fiber.homes.slurm.home import build_slurm_home as build
from tests.homes.slurm.replaykit import losses

if TYPE_CHECKING:
    from tests.barehost.clusterkit import BareHost, SlurmCluster
    from tests.security.userkit import JobUser

pytestmark = pytest.mark.slurm
WAIT_S = 30.0

RECORDING_JOB = """#!/bin/sh
out="$PWD/env-$SLURM_JOB_ID.txt"
env > "$out.tmp" && mv "$out.tmp" "$out"
exec sleep 300
"""


def recorded_env(cluster: SlurmCluster, user: JobUser, workdir: Path,
                 *sbatch_args: str) -> dict[str, str]:
    """Submit a job (as ``user``) that records its environment and sleeps; return the
    recording."""
    job_id = cluster.submit(RECORDING_JOB, *sbatch_args, workdir=workdir, user=user)
    cluster.wait_for(job_id, {"RUNNING"})
    path = workdir / f"env-{job_id}.txt"
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"job {job_id} recorded no environment"
        time.sleep(0.05)
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def home_for(cluster: SlurmCluster, env: dict[str, str], clock: FakeClock,
             tmp_path: Path) -> SlurmHome:
    config = SlurmHomeConfig(state_root=tmp_path / "state", poll_every=1.0, stale_after=3.0)
    return asyncio.run(build(env, clock, CliControl(cluster.env, timeout=10), config))


def test_a_running_job_is_fresh_and_scancel_loses_scope_once(
        slurm_cluster: SlurmCluster, tmp_path: Path, clock: FakeClock, job_user: JobUser,
        job_dir: Callable[[JobUser], Path]) -> None:
    env = recorded_env(slurm_cluster, job_user, job_dir(job_user), "-w", "n1", "--gres=gpu:1",
                       "-J", "home test")
    home = home_for(slurm_cluster, env, clock, tmp_path)
    job_id = home.job.job_id
    assert home.job.gpus and home.job.gpu_source == "SLURM_JOB_GPUS"

    async def main() -> list[str]:
        async with losses(home) as delivered:
            await scancel_and_watch(home, slurm_cluster)
        return delivered

    delivered = asyncio.run(main())
    assert len(delivered) == 1 and delivered[0].startswith(f"job {job_id} left RUNNING: ")


async def scancel_and_watch(home: SlurmHome, cluster: SlurmCluster) -> None:
    """Poll: fresh; scancel the job; poll until it is lost, and on after it left the queue."""
    job_id = home.job.job_id
    assert await home.poll.once() is None
    assert home.health().read().fresh and home.lost is None
    names = {c.key: c.value for c in home.scope()}
    assert names["slurm.job_id"] == str(job_id) and names["slurm.node"] == "n1"
    assert names["slurm.cluster"] == "citest" and names["slurm.job_name"] == "home test"
    assert cluster.run("scancel", str(job_id)).returncode == 0
    deadline = time.monotonic() + WAIT_S
    while home.lost is None:
        assert time.monotonic() < deadline, "the cancelled job was never seen leaving"
        assert await home.poll.once() is None
        await asyncio.sleep(0.1)
    cluster.wait_done(job_id)
    for _ in range(3):  # and after it has left the queue
        assert await home.poll.once() is None


@dataclasses.dataclass
class PrivateCluster:
    """A cluster of our own, and the daemons a test started on it besides `up`'s."""

    cluster: SlurmCluster
    spawned: list[subprocess.Popen[bytes]]


@pytest.fixture
def private_cluster(private_dir: Path, slurm_cluster: SlurmCluster,
                    bare_host_script: BareHost) -> Iterator[PrivateCluster]:
    """A second cluster under private_dir (shaped like ``slurm_cluster``), torn down at the end:
    its jobs cancelled while slurmctld still answers, `down`, then what the test spawned."""
    bare_host, exports = bare_host_script.run, bare_host_script.exports
    if os.geteuid() != 0:
        pytest.skip("bare-host up needs root")
    env = bare_host_script.private_env(private_dir)
    up = bare_host("up", "--no-hooks", env=env)
    assert up.returncode == 0, up.stderr
    variables = exports(bare_host("env", env=env).stdout)
    private = PrivateCluster(dataclasses.replace(
        slurm_cluster, env=env | variables, run_dir=Path(variables["SLURM_FIBER_CLUSTER_DIR"])),
        [])
    try:
        yield private
    finally:
        cluster = private.cluster
        jobs = cluster.run("squeue", "-h", "-o", "%A", timeout=10).stdout.split()
        if jobs:
            cluster.run("scancel", *jobs, timeout=10)
            for job in jobs:
                cluster.wait_done(int(job))
        bare_host("down", env=env)
        for proc in private.spawned:
            proc.terminate()
            proc.wait(timeout=WAIT_S)


def stop_slurmctld(cluster: SlurmCluster) -> None:
    """SIGTERM the slurmctld `up` started (it saves its state) and wait until it has exited."""
    pid = json.loads((cluster.run_dir / "started.json").read_text())["slurmctld"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + WAIT_S
    while subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                         text=True).stdout.strip() not in {"", "Z"}:
        assert time.monotonic() < deadline, "slurmctld did not stop"
        time.sleep(0.05)


def test_slurmctld_stopped_goes_stale_and_recovers(
        private_cluster: PrivateCluster, tmp_path: Path, clock: FakeClock, job_user: JobUser,
        job_dir: Callable[[JobUser], Path]) -> None:
    cluster = private_cluster.cluster
    env = recorded_env(cluster, job_user, job_dir(job_user), "-w", "n2")
    home = home_for(cluster, env, clock, tmp_path)
    errors: list[BaseException] = []
    recovered: list[bool] = []
    home.poll.on_error = errors.append
    home.poll.on_recovered = lambda: recovered.append(True)

    async def main() -> None:
        assert await home.poll.once() is None
        stop_slurmctld(cluster)
        for _ in range(4):
            await clock.advance_and_settle(1.0)
            assert isinstance(await home.poll.once(), SlurmDownError)
        assert home.health().read().state is HealthState.STALE
        # Restarted without -c, slurmctld recovers the running job from its saved state.
        private_cluster.spawned.append(subprocess.Popen(
            ["slurmctld", "-D", "-f", cluster.env["SLURM_CONF"]], env=cluster.env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True))
        deadline = time.monotonic() + WAIT_S
        while await home.poll.once() is not None:
            assert time.monotonic() < deadline, f"no recovery: {errors[-1]}"
            await asyncio.sleep(0.1)

    asyncio.run(main())
    assert home.health().read().fresh and recovered == [True]
    assert home.lost is None  # the job kept running through the outage
    assert str(errors[0]).startswith("slurmctld is DOWN")
