"""One job user's job against another's on the real cluster (issue 13; markers hostile, slurm).

alice (sfalice) runs a GPU job on n1: the prolog claimed her GPU's lease in
her job's name (root's record in the root-only lease area) and her fiberd
verified it; the job is held for the whole module. mallory (sfmallory), another job user on the
same node, then:

(a) from a GPU job of her own, tries to take alice's lease in the node's
    lease area: rename alice's lease entry (``mv``), open the lease state
    for writing, and write into alice's lease entry. Every attempt must
    fail, and alice's fiberd must keep her GPU: the lease is still her
    job's, her holder record and every state entry naming her party or her
    GPU are unchanged (mallory's own GPU job changes only her own GPU's
    entries), and a fiber of hers still runs with it. (A successful attempt
    is undone at once, so a failing run leaves the cluster usable.)
(b) from a fiber of her own job's fiberd, tries to list alice's job state
    dir, read alice's token in it, and connect to alice's fiberd socket.
    Every attempt must be refused by the kernel (permission denied).

What each attempt returned is recorded by mallory's job in her work dir
and read by the test (root).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes.slurm.leases import AREA_OWNERS
from slurm_fiber.homes.slurm.paths import JobPaths, gpu_resource, job_paths
from slurm_fiber.homes.slurm.siteconfig import load_site_config
from slurm_fiber.lease import Leases
from slurm_fiber.lease.dirlease import HOLDER_FILE
from tests.barehost.clusterkit import SlurmCluster, new_job_dir
from tests.barehost.fiberjobkit import fiberd_pid, job_script, wait_file
from tests.security.userkit import JobUser

pytestmark = pytest.mark.slurm  # slurm_cluster, _job_dirs, job_dir: tests/conftest.py's
NODE = "n1"

ALICE_BODY = """printf %s "$SLURM_JOB_GPUS" > "gpus-$id.tmp" && mv "gpus-$id.tmp" "gpus-$id"
"""

# mallory's GPU job: each attempt on alice's lease, its exit status and first error line.
LEASE_ATTACK = """#!/bin/sh
cd "{work}"
lease="{lease_dir}"
r="{resource}"
try() {{ what=$1; shift; err=$("$@" 2>&1 >/dev/null); rc=$?; echo "try $what $rc $err"; }}
{{
  try rename mv "$lease/$r" "$lease/$r.mallory"
  [ -d "$lease/$r.mallory" ] && mv "$lease/$r.mallory" "$lease/$r"
  try state sh -c ': >> "$1"' sh "$lease/state.json"
  try entry touch "$lease/$r/mallory"
  rm -f "$lease/$r/mallory"
  printf 'gpus %s\\n' "$SLURM_JOB_GPUS"
}} > "attack-$SLURM_JOB_ID.tmp"
mv "attack-$SLURM_JOB_ID.tmp" "attack-$SLURM_JOB_ID"
"""

# A fiber of mallory's job: each attempt on alice's state dir and socket.
STATE_ATTACK = """$SF/fiberctl run -- sh -c '
try() {{ what=$1; shift; err=$("$@" 2>&1 >/dev/null); rc=$?; echo "try $what $rc $err"; }}
try list ls "$1"
try token cat "$1/grants/job-$2.jwt"
try connect "$3/python" -c "import socket, sys
try: socket.socket(socket.AF_UNIX).connect(sys.argv[1])
except OSError as err: sys.exit(repr(err))" "$1/fiberd.sock"
FIBERD_SOCKET="$1/fiberd.sock" "$3/fiberctl" status --json > /dev/null 2>&1
echo "fiberctl $?"
echo "uid $(id -u)"
' sh "{state}" "{victim}" "$SF" > "attack-$id.tmp" 2>&1
mv "attack-$id.tmp" "attack-$id"
"""


@dataclass(frozen=True)
class Victim:
    """alice's running GPU job: its id, work dir, paths on the node, and GPU resource."""

    user: JobUser
    job: int
    work: Path
    paths: JobPaths
    resource: str

    def party(self) -> str:
        return f"slurm-job:citest:{self.job}"


def attempts(text: str) -> dict[str, tuple[int, str]]:
    """mallory's record ("try <what> <status> <error>" lines): what -> (status, error)."""
    found = {}
    for line in text.splitlines():
        if line.startswith("try "):
            what, rc, err = [*line.split(" ", 3)[1:], ""][:3]
            found[what] = (int(rc), err)
    return found


@pytest.fixture(scope="module")
def victim(slurm_cluster: SlurmCluster, alice: JobUser, _job_dirs: Path) -> Iterator[Victim]:
    """alice's GPU job on n1 with its fiberd ready, held until the module ends."""
    assert slurm_cluster.site_config is not None, "the cluster is up without hooks"
    site = load_site_config({"SLURM_FIBER_CONFIG": str(slurm_cluster.site_config)})
    work = new_job_dir(_job_dirs / "victim-alice", alice)
    job = slurm_cluster.submit(job_script(slurm_cluster, work, ALICE_BODY, hold=True),
                               "-w", NODE, "--gres=gpu:1", "-t", "5", workdir=work, user=alice)
    try:
        gpu = int(wait_file(work / f"gpus-{job}", timeout=120))
        fiberd_pid(work, job)  # ready
        yield Victim(alice, job, work, job_paths(site.state_root, NODE, job),
                     gpu_resource(NODE, gpu))
    finally:
        (work / f"release-{job}").touch()
        slurm_cluster.wait_done(job)


def holder_of(victim: Victim) -> str | None:
    """The session holding the victim's GPU lease in the node's lease area, if any."""
    leases = Leases(victim.paths.lease_dir, victim.paths.lease_state, FakeClock(),
                    owners=AREA_OWNERS)
    holder = leases.dir.get(victim.resource)
    return None if holder is None else holder.party().session


def alices_entries(victim: Victim) -> dict[str, object]:
    """What of the node's lease area is alice's: her lease's holder record and every entry of
    the state document that names her party or her GPU (by key or in its value)."""
    mine = (victim.party(), victim.resource)
    # Whole names: job 12's party is a prefix of job 123's, which may be mallory's.
    her = re.compile("(?:" + "|".join(re.escape(m) for m in mine) + r")(?![0-9])")

    def names_her(key: str, value: object) -> bool:
        return key in mine or her.search(json.dumps(value)) is not None

    doc = json.loads(victim.paths.lease_state.read_text())
    state: dict[str, object] = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            state[key] = {k: v for k, v in value.items() if names_her(k, v)}
        elif isinstance(value, list):
            state[key] = [v for v in value if names_her("", v)]
        else:
            state[key] = value if names_her(key, value) else None
    record = (victim.paths.lease_dir / victim.resource / HOLDER_FILE).read_bytes()
    return {"holder": record, "state": state}


def fiber_gpu(cluster: SlurmCluster, victim: Victim) -> tuple[int, str]:
    """A fiber of alice's fiberd, started by alice from outside her job: its CUDA devices."""
    out = cluster.run(str(cluster.site_bin / "fiberctl"), "run", "--", "sh", "-c",
                      'echo "$CUDA_VISIBLE_DEVICES"', user=victim.user,
                      extra_env={"FIBERD_SOCKET": str(victim.paths.socket)})
    return out.returncode, out.stdout.strip() or out.stderr.strip()


def test_another_users_gpu_job_cannot_take_or_move_a_jobs_gpu_lease(
        slurm_cluster: SlurmCluster, victim: Victim, mallory: JobUser,
        job_dir: Callable[[JobUser], Path]) -> None:
    index = victim.resource.rsplit(":", 1)[1]
    assert holder_of(victim) == victim.party(), "alice's fiberd does not hold her GPU"
    hers_before = alices_entries(victim)
    work = job_dir(mallory)
    script = LEASE_ATTACK.format(work=work, lease_dir=victim.paths.lease_dir,
                                 resource=victim.resource)
    job = slurm_cluster.submit(script, "-w", NODE, "--gres=gpu:1", "-t", "2", workdir=work,
                               user=mallory)
    record = wait_file(work / f"attack-{job}", timeout=120)
    slurm_cluster.wait_done(job)
    tried = attempts(record)
    assert set(tried) == {"rename", "state", "entry"}, record
    assert f"gpus {index}" not in record, "mallory's job was given alice's GPU"
    succeeded = [what for what, (rc, _) in tried.items() if rc == 0]
    assert not succeeded, f"mallory could {succeeded} alice's lease: {record}"
    assert holder_of(victim) == victim.party()
    assert alices_entries(victim) == hers_before
    assert fiber_gpu(slurm_cluster, victim) == (0, index)


def test_another_users_fiber_cannot_read_a_jobs_state_or_reach_its_fiberd(
        slurm_cluster: SlurmCluster, victim: Victim, mallory: JobUser,
        job_dir: Callable[[JobUser], Path]) -> None:
    work = job_dir(mallory)
    body = STATE_ATTACK.format(state=victim.paths.state_dir, victim=victim.job)
    job = slurm_cluster.submit(job_script(slurm_cluster, work, body), "-w", NODE, "-t", "2",
                               workdir=work, user=mallory)
    record = wait_file(work / f"attack-{job}", timeout=120)
    slurm_cluster.wait_done(job)
    assert f"uid {mallory.uid}" in record, record  # it ran as a fiber of mallory's job
    tried = attempts(record)
    for what in ("list", "token", "connect"):
        rc, err = tried[what]
        assert rc != 0 and ("Permission denied" in err or "PermissionError" in err), record
    assert "fiberctl 0" not in record and "fiberctl " in record, record
    # alice still reaches her own fiberd.
    status = slurm_cluster.run(str(slurm_cluster.site_bin / "fiberctl"), "status", "--json",
                               user=victim.user,
                               extra_env={"FIBERD_SOCKET": str(victim.paths.socket)})
    assert status.returncode == 0 and json.loads(status.stdout)["ready"], status.stderr
