"""A job's fiberd through a slurmctld outage, on a private cluster (the shared one stays up).

The job runs `srun --overlap fiberd-run &` with small FIBERD_STALE_TTL and
FIBERD_FENCE_TTL in its environment and starts a long fiber. The test then
stops slurmctld (`bare-host stop-ctld`) and talks to the job's fiberd from
outside the job through its socket, as the job's user (the job runs as
sfalice), since srun itself needs slurmctld:
health goes stale, a Clone for an unknown grant misses source_stale (not
unknown_grant), the running fiber is stopped when the fence ends and a
Clone misses fenced; after `bare-host start-ctld` health is fresh again
and Clones run. The waits are for the real daemons, polled every 0.1 s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurm_fiber.client.fiberctl import EXIT_FINAL_MISS, EXIT_RETRYABLE_MISS
from slurm_fiber.homes.slurm.paths import job_paths
from slurm_fiber.homes.slurm.siteconfig import SiteConfig, load_site_config
from tests.barehost.fiberjobkit import (
    FIBERCTL,
    audit_events,
    fiberd_pid,
    job_script,
    leftovers,
    settle,
    wait_file,
)

if TYPE_CHECKING:
    from tests.barehost.clusterkit import BareHost, SlurmCluster
    from tests.security.userkit import JobUser

pytestmark = pytest.mark.slurm
CLUSTER = "ctldtest"
STALE_TTL = 3.0
FENCE_TTL = 8.0
TTLS = {"FIBERD_STALE_TTL": f"{STALE_TTL:g}", "FIBERD_FENCE_TTL": f"{FENCE_TTL:g}",
        "FIBERD_GRACE": "1"}

# A fiber that runs until fiberd stops it; fiberctl's exit status recorded when it does.
FENCED_FIBER = f"""({FIBERCTL} run -- sleep 300; echo $? > "fiberexit-$id.tmp"
 mv "fiberexit-$id.tmp" "fiberexit-$id") &
until {FIBERCTL} ls --json 2>/dev/null | grep -q '"running"'; do sleep 0.1; done
touch "started-$id"
"""


@pytest.fixture
def ctld_cluster(tmp_path: Path, slurm_cluster: SlurmCluster,
                 bare_host_script: BareHost) -> Iterator[SlurmCluster]:
    """A private cluster with the slurm_fiber hooks, whose jobs' fiberds get small TTLs;
    torn down at the end (slurmctld started again first, so its jobs can be cancelled)."""
    if os.geteuid() != 0:
        pytest.skip("bare-host up needs root")
    # Short: the job's socket goes under the run dir, and a Unix socket path has 107 bytes.
    short = Path(tempfile.mkdtemp(prefix="sf-ctld-", dir="/tmp"))
    env = bare_host_script.private_env(short) | {"SLURM_FIBER_CLUSTER_NAME": CLUSTER}
    try:
        up = bare_host_script.run("up", env=env)
        assert up.returncode == 0, up.stderr
        variables = bare_host_script.exports(bare_host_script.run("env", env=env).stdout)
        yield dataclasses.replace(
            slurm_cluster, env=env | variables | TTLS,
            run_dir=Path(variables["SLURM_FIBER_CLUSTER_DIR"]),
            site_config=Path(variables["SLURM_FIBER_CONFIG"]))
    finally:
        bare_host_script.run("start-ctld", env=env)
        down = bare_host_script.run("down", env=env)
        shutil.rmtree(short)
    assert down.returncode == 0, down.stderr


@dataclasses.dataclass(frozen=True)
class Outside:
    """The job's fiberd socket, reached from outside the job by the job's own user."""

    cluster: SlurmCluster
    user: JobUser
    socket: Path

    def fiberctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The site's fiberctl against the socket, as the job user; blocks until it exits."""
        return self.cluster.run(str(self.cluster.site_bin / "fiberctl"), *args, user=self.user,
                                extra_env={"FIBERD_SOCKET": str(self.socket)})

    def health(self) -> dict[str, object]:
        out = self.fiberctl("status", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["health"]

    def health_is(self, state: str) -> list[str]:
        seen = self.health()["state"]
        return [] if seen == state else [f"health is {seen}"]


def test_a_slurmctld_outage_goes_stale_fences_and_recovers(
        ctld_cluster: SlurmCluster, bare_host_script: BareHost, job_user: JobUser,
        job_dir: Callable[[JobUser], Path]) -> None:
    site: SiteConfig = load_site_config({"SLURM_FIBER_CONFIG": str(ctld_cluster.site_config)})
    bare = {"SLURM_FIBER_CLUSTER_DIR": str(ctld_cluster.run_dir),
            "SLURM_FIBER_CLUSTER_NAME": CLUSTER}
    work = job_dir(job_user)
    job = ctld_cluster.submit(job_script(ctld_cluster, work, FENCED_FIBER, hold=True), "-w",
                              "n1", "--gres=gpu:1", "-t", "5", workdir=work, user=job_user)
    wait_file(work / f"started-{job}", timeout=120)
    outside = Outside(ctld_cluster, job_user, job_paths(site.state_root, "n1", job).socket)
    fiberctl, health, health_is = outside.fiberctl, outside.health, outside.health_is
    # With slurmctld answering, health stays fresh between polls, however small the TTL.
    deadline = time.monotonic() + 2 * STALE_TTL
    while time.monotonic() < deadline:
        assert health()["state"] == "fresh"
        time.sleep(0.2)
    unknown = fiberctl("run", "--grant", "no-such-grant", "--", "true")
    assert (unknown.returncode, unknown.stderr.split(":")[0]) == (
        EXIT_FINAL_MISS, "unknown_grant"), unknown.stderr

    stop = bare_host_script.run("stop-ctld", env=os.environ | bare)
    assert stop.returncode == 0, stop.stderr
    stopped_at = time.monotonic()
    settle(lambda: health_is("stale"), "health did not go stale", STALE_TTL + 10)
    stale = fiberctl("run", "--grant", "no-such-grant", "--", "true")
    assert (stale.returncode, stale.stderr.split(":")[0]) == (
        EXIT_RETRYABLE_MISS, "source_stale"), stale.stderr

    status = int(wait_file(work / f"fiberexit-{job}", timeout=FENCE_TTL + 20))
    fenced_after = time.monotonic() - stopped_at
    assert status in {143, 137}, status  # SIGTERM, or SIGKILL after the grace
    # The fence ends FENCE_TTL after the last answer, at most a poll (1 s) before the stop.
    assert FENCE_TTL - 3 <= fenced_after <= FENCE_TTL + 5, fenced_after
    fenced = fiberctl("run", "--", "true")
    assert (fenced.returncode, fenced.stderr.split(":")[0]) == (
        EXIT_RETRYABLE_MISS, "fenced"), fenced.stderr

    start = bare_host_script.run("start-ctld", env=os.environ | bare)
    assert start.returncode == 0, start.stderr
    settle(lambda: health_is("fresh"), "health did not recover", 30)
    again = fiberctl("run", "--", "sh", "-c", "echo back")
    assert (again.returncode, again.stdout) == (0, "back\n"), again.stderr

    pid = fiberd_pid(work, job)
    (work / f"release-{job}").touch()
    ctld_cluster.wait_done(job)
    settle(lambda: leftovers(site, ctld_cluster.env["SLURM_CONF"], CLUSTER, "n1", job, [pid]),
           f"job {job} left something behind")
    records = audit_events(site, "n1", job)
    events = [r["event"] for r in records]
    assert events.count("clone") == 2 and events.count("miss") == 3, events
    first_exit = next(r for r in records if r["event"] == "fiber_exit")
    assert first_exit["exit"]["stopped"], first_exit
