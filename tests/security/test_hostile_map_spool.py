"""Issue 38, High: another user swaps ``fiberctl map --nodes all``'s spool in a shared dir.

sfalice runs a map over both nodes of a job from a directory every user may write (a
project's shared scratch: mode 0777, no sticky bit). sfmallory, a process of their own on
the node, watches that directory: as soon as the map's ``.fibermap-*`` spool appears
they rename it away and put a directory of their own in its place, whose options run
``id -u`` into a file of theirs. The shares must refuse the replaced spool (one line),
so mallory's command never runs as alice, and the map must not exit 0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.barehost.fiberjobkit import FIBERCTL, READY_S, ended, wait_file

if TYPE_CHECKING:
    from tests.barehost.clusterkit import SlurmCluster
    from tests.security.userkit import JobUser

    WorkDir = Callable[[JobUser], Path]

pytestmark = pytest.mark.slurm

# The attacker: swap the first .fibermap-* that appears for a directory of its own whose
# argv.json runs `id -u > DROP/pwned` (0777 so the victim's shares may write their
# summaries there, and the map would see them); say what it did.
SWAPPER = r"""
import json, os, sys, time
shared, drop = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 240
while time.monotonic() < deadline:
    names = [n for n in os.listdir(shared) if n.startswith(".fibermap-")
             and not n.endswith(".moved")]
    if names:
        break
    time.sleep(0.001)
else:
    print("no spool seen", flush=True); sys.exit(1)
time.sleep(0.05)  # the map has written its files by now; its shares start later
name = names[0]
prep = os.path.join(shared, ".mallory-prep")
os.mkdir(prep)
with open(os.path.join(prep, "argv.json"), "w") as f:
    json.dump(["--range", "1-2", "--", "sh", "-c", f"id -u > {drop}/pwned"], f)
with open(os.path.join(prep, "args"), "w") as f:
    f.write("1\n2\n")
os.chmod(prep, 0o777)
os.rename(os.path.join(shared, name), os.path.join(shared, name + ".moved"))
os.rename(prep, os.path.join(shared, name))
print("swapped", name, flush=True)
"""

PRELUDE = f"""#!/bin/sh
SF="{{bin}}"
cd "{{work}}"
id=$SLURM_JOB_ID
srun --overlap --ntasks-per-node=1 -N2 "$SF/fiberd-run" > "fiberd-$id.log" 2>&1 &
if ! srun --overlap --ntasks-per-node=1 -N2 {FIBERCTL} wait --timeout {READY_S} \\
    > "wait-$id.log" 2>&1; then
  echo "fiberd not ready on both nodes" > "failed-$id"; exit 1
fi
cd "{{shared}}"
{FIBERCTL} map --nodes all -j2 --range 1-4 -- echo {{{{}}}} > "{{work}}/out-$id.tmp" \\
  2> "{{work}}/err-$id"
echo "rc $?" >> "{{work}}/out-$id.tmp"
mv "{{work}}/out-$id.tmp" "{{work}}/out-$id"
"""


@pytest.fixture
def shared_dirs() -> Iterator[tuple[Path, Path]]:
    """(a directory every user may write, no sticky bit; mallory's drop box)."""
    base = Path(tempfile.mkdtemp(prefix="sf-shared-map-", dir="/tmp"))
    base.chmod(0o755)
    shared, drop = base / "shared", base / "drop"
    shared.mkdir()
    shared.chmod(0o777)
    drop.mkdir()
    drop.chmod(0o777)
    yield shared, drop
    shutil.rmtree(base, ignore_errors=True)


def test_a_swapped_map_spool_runs_nothing_of_the_other_users_and_fails_the_map(
        slurm_cluster: SlurmCluster, job_user: JobUser, other_user: JobUser,
        job_dir: WorkDir, shared_dirs: tuple[Path, Path]) -> None:
    shared, drop = shared_dirs
    work = job_dir(job_user)
    swapper = subprocess.Popen(["/usr/bin/python3", "-c", SWAPPER, str(shared), str(drop)],
                               stdout=subprocess.PIPE, text=True, **other_user.spawn_args())
    try:
        script = PRELUDE.format(bin=slurm_cluster.site_bin, work=work, shared=shared)
        job = slurm_cluster.submit(script, "-N2", "-t", "3", workdir=work, user=job_user)
        out = wait_file(work / f"out-{job}", timeout=180).splitlines()
        swapped = swapper.communicate(timeout=30)[0]
    finally:
        swapper.kill()
        swapper.wait()
    err = (work / f"err-{job}").read_text()
    assert "swapped" in swapped, swapped  # the attack was made
    pwned = drop / "pwned"
    assert not pwned.exists(), (
        f"mallory's command ran as uid {pwned.read_text().strip()} (alice is "
        f"{job_user.uid}); map: {out} {err}")
    assert out[-1] != "rc 0", (out, err)  # the map says it failed
    assert "runs nothing" in err and "replaced" in err, err
    assert ended(slurm_cluster, job) == "COMPLETED", err
    assert os.stat(shared).st_uid == 0
