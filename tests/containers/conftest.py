"""The `container_cluster` fixture: the container Slurm cluster, one release after another.

Session-scoped and parametrized by release (22.05, 24.11, 26.05, or the comma-separated
list in SLURM_FIBER_CONTAINER_RELEASES): pytest runs every test of one release before the
next. For each release it runs `docker/slurm-cluster/cluster up --release R` (which
builds what is missing: the debootstrap base and the images are cached outside the repo,
so a warm `up` takes seconds) and `cluster down` after the release's tests (the
engine it started is stopped, and the node cgroups it made for Slurm's cgroup/v2 must be
gone; the next `up` starts it again in about a second). The machine has one engine and
one cluster at a time: a release's tests hold ``/run/slurm-fiber-cluster-session.lock``
from its `up` to its `down` (``./dev test`` builds under the same lock), so two test runs
on one machine take turns rather than bring each other's cluster down. Needs
root; without root it skips (which CI turns into a failure). Tests talk to the cluster
only through `docker exec` (``ContainerCluster.run``), jobs as job users via runuser.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

CLUSTER = Path(__file__).resolve().parents[2] / "docker" / "slurm-cluster" / "cluster"
RELEASES = tuple(os.environ.get("SLURM_FIBER_CONTAINER_RELEASES", "22.05,24.11,26.05")
                 .split(","))
SESSION_LOCK = Path("/run/slurm-fiber-cluster-session.lock")
UP_TIMEOUT_S = 1800  # a cold build of one release: debootstrap, apt, wheels (minutes)
FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                      "OUT_OF_MEMORY"})


def cluster(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run docker/slurm-cluster/cluster with ``args``; never raises on a non-zero exit."""
    return subprocess.run([str(CLUSTER), *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


@dataclass(frozen=True)
class ContainerCluster:
    """A running container cluster of ``release``; ``docker_env`` names its engine."""

    release: str
    docker_env: dict[str, str]

    def run(self, service: str, *argv: str, user: str | None = None, stdin: str | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``argv`` in ``service``'s container (as ``user`` via runuser); never raises."""
        who = ["runuser", "-u", user, "--"] if user else []
        return subprocess.run(["docker", "exec", "-i", f"slurm-fiber-{service}", *who, *argv],
                              input=stdin, capture_output=True, text=True, timeout=timeout,
                              env=self.docker_env, check=False)

    def docker(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["docker", *argv], capture_output=True, text=True, timeout=60,
                              env=self.docker_env, check=False)

    def wait_finished(self, job_id: str, within: float = 120.0) -> str:
        """Poll the job's state every 0.1 s until it finished (at most ``within`` s)."""
        deadline = time.monotonic() + within
        while True:
            out = self.run("slurmctld", "squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T")
            state = out.stdout.strip()
            if state in FINISHED:
                return state
            assert time.monotonic() < deadline, f"job {job_id} still {state} after {within} s"
            time.sleep(0.1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A container test's time bound covers its release's `up` (a cold build, or the wait
    for another run's cluster to go), which pytest-timeout counts against the first test of
    the release; each test's own waits stay bounded by their own timeouts."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.timeout(UP_TIMEOUT_S + 600))


@pytest.fixture(scope="session", params=RELEASES)
def container_cluster(request: pytest.FixtureRequest) -> Iterator[ContainerCluster]:
    if os.geteuid() != 0:
        pytest.skip("the container cluster needs root (it starts dockerd)")
    release = request.param
    with open(SESSION_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _release_up(release)


def _release_up(release: str) -> Iterator[ContainerCluster]:
    """Bring ``release`` up, yield it, bring it down and check its node cgroups are gone."""
    up = cluster("up", "--release", release, timeout=UP_TIMEOUT_S)
    if up.returncode != 0:
        cluster("down")
        pytest.fail(f"cluster up --release {release} failed:\n{up.stdout}{up.stderr[-4000:]}")
    exports = cluster("env").stdout.split()
    env = dict(os.environ)
    env.update(item.split("=", 1) for item in exports if "=" in item)
    cgroups = json.loads(cluster("status", "--json").stdout)["cgroups"]
    try:
        yield ContainerCluster(release, env)
    finally:
        down = cluster("down")
    assert down.returncode == 0, down.stdout + down.stderr
    left = [path for path in cgroups.values() if Path(path).exists()]
    assert not left, f"cluster down left the node cgroups {left}"
