"""Batch jobs that run their own fiberd, and what such a job leaves behind once it ended.

``job_script`` builds the script a job author writes: `srun --overlap
fiberd-run &`, a wait until `fiberctl status --json` reports ready, then a
test-specific body, optionally held until the test drops a ``release-<id>``
file. Every file a job writes goes to the test's work dir, named after the
job id, and is written whole (tmp + mv) when a test waits for it.
``leftovers`` names everything of a job that must be gone after its epilog:
its processes (by the job id and this cluster's SLURM_CONF in their
environment), its fiberd and fibers by pid, its delegated cgroup, its groups in
Slurm's cgroup v1 hierarchies (with the cluster's cgroup/v1 plugin), its state
dir (with the grant files), and its GPU leases held or granted. Jobs run as
a job user with the cluster's site install (``bare-host up`` makes it): the
script sets ``SF`` to the site venv's bin dir, and bodies call
``$SF/fiberctl`` (``FIBERCTL``) by absolute path, as docs/slurm.md tells job
authors.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes.slurm.cgroup_v1 import job_groups
from slurm_fiber.homes.slurm.paths import job_paths
from slurm_fiber.homes.slurm.siteconfig import SiteConfig
from slurm_fiber.lease import Leases

if TYPE_CHECKING:
    from tests.barehost.clusterkit import SlurmCluster

FIBERCTL = '"$SF/fiberctl"'  # in a job script: the site venv's fiberctl
# A job script's lines that SIGKILL the job's fiberd (its pid from ``fiberctl status``).
KILL_FIBERD = f"""pid=$({FIBERCTL} status --json | sed 's/.*"pid": \\([0-9]*\\).*/\\1/')
kill -9 "$pid"
"""
READY_S = 60  # how long a job waits for its fiberd before it gives up

PRELUDE = f"""#!/bin/sh
SF="{{bin}}"
cd "{{work}}"
id=$SLURM_JOB_ID
srun --overlap -n1 "$SF/fiberd-run" > "fiberd-$id.log" 2>&1 &
step=$!
i=0
until {FIBERCTL} status --json > "status-$id.tmp" 2>/dev/null \\
    && grep -q '"ready": true' "status-$id.tmp"; do
  i=$((i+1))
  if ! kill -0 $step; then echo "fiberd-run exited" > "failed-$id"; exit 1; fi
  if [ $i -gt {READY_S * 10} ]; then echo "fiberd not ready" > "failed-$id"; exit 1; fi
  sleep 0.1
done
mv "status-$id.tmp" "status-$id.json"
"""
HOLD = """i=0
while [ ! -f "release-$id" ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done
"""


def job_script(cluster: SlurmCluster, work: Path, body: str, *, hold: bool = False) -> str:
    """The job's script: the cluster's site fiberd started and ready, then ``body`` (sh,
    ``$id`` is the job id, ``$SF`` the site bin dir), then (``hold``) a wait of at most 300 s
    for ``release-<id>`` in ``work``."""
    return PRELUDE.format(bin=cluster.site_bin, work=work) + body + (HOLD if hold else "")


def settle(check: Callable[[], list[str]], what: str, timeout: float = 60.0) -> None:
    """Poll ``check`` every 0.1 s until it returns no complaints; fail with the last ones."""
    deadline = time.monotonic() + timeout
    complaints = check()
    while complaints:
        assert time.monotonic() < deadline, f"{what} after {timeout} s: {complaints}"
        time.sleep(0.1)
        complaints = check()


def wait_file(path: Path, timeout: float = 60.0) -> str:
    """The text of ``path`` once it exists (a job wrote it), or the test fails; a job that gave
    up on its fiberd fails it at once, with fiberd's log."""
    failed = path.parent / f"failed-{path.name.rsplit('-', 1)[-1].split('.')[0]}"

    def missing() -> list[str]:
        if failed.exists():
            log = path.parent / failed.name.replace("failed-", "fiberd-")
            raise AssertionError(f"{failed.read_text().strip()}: "
                                 f"{log.read_text()[-2000:] if log.exists() else ''}")
        return [] if path.exists() else [f"no {path.name}"]

    settle(missing, f"the job did not write {path.name}", timeout)
    return path.read_text()


def job_state(cluster: SlurmCluster, job_id: int) -> str:
    """The job's JobState from `scontrol -o show job` (squeue stops listing a finished job)."""
    out = cluster.run("scontrol", "-o", "show", "job", str(job_id))
    fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
    return fields.get("JobState", f"unknown ({out.stderr.strip()})")


def ended(cluster: SlurmCluster, job_id: int, timeout: float = 60.0) -> str:
    """Wait until the job left the queue; its final JobState."""
    cluster.wait_done(job_id, timeout)
    return job_state(cluster, job_id)


def fiberd_pid(work: Path, job_id: int) -> int:
    """The pid of the job's fiberd, from the status its script recorded."""
    return int(json.loads(wait_file(work / f"status-{job_id}.json"))["status"]["pid"])


def _stat(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """The pid is a process and not a zombie (PID 1 reaps late here)."""
    return _stat(pid) not in (None, "Z")


def job_processes(slurm_conf: str, job_id: int) -> list[int]:
    """Live processes whose environment names job ``job_id`` of the cluster at ``slurm_conf``."""
    marks = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_CONF={slurm_conf}".encode()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not alive(int(entry.name)):
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if marks <= environ:
            found.append(int(entry.name))
    return found


def leftovers(site: SiteConfig, slurm_conf: str, cluster: str, node: str, job_id: int,
              pids: Iterable[int] = (), uid: int | None = None) -> list[str]:
    """What of job ``job_id`` remains on ``node``: one line per leftover, [] when none.

    ``pids`` are processes the job had (its fiberd, its fibers) that must be gone too;
    ``uid``: the job's user, whose Slurm cgroup v1 groups of the job must be gone too.
    """
    paths = job_paths(site.state_root, node, job_id)
    left = [f"process {pid} with the job's environment" for pid in
            job_processes(slurm_conf, job_id)]
    left += [f"pid {pid} of the job still runs" for pid in pids if alive(pid)]
    if site.cgroup_parent is not None and (site.cgroup_parent / node / f"job_{job_id}").exists():
        left.append("the job's delegated cgroup")
    if uid is not None:
        left += [f"the job's cgroup v1 group {g}" for g in job_groups(slurm_conf, node, uid,
                                                                        job_id)]
    if paths.grantdir.exists():
        left.append(f"the grantdir {paths.grantdir}")
    if paths.state_dir.exists():
        left.append(f"the state dir {paths.state_dir}")
    leases = Leases(paths.lease_dir, paths.lease_state, FakeClock())
    party = f"slurm-job:{cluster}:{job_id}"
    left += [f"lease {h.env} held" for h in leases.dir.list() if h.party().session == party]
    left += [f"lease {g.resource} granted" for g in leases.state().grants
             if g.to.session == party]
    return left


def audit_events(site: SiteConfig, node: str, job_id: int) -> list[dict[str, object]]:
    """The records of the audit log the epilog kept for the job ([] when there is none)."""
    path = site.state_root / "nodes" / node / "audit" / f"job-{job_id}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
