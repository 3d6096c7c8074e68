"""Issue 38, medium: the epilog killed the cgroup a job user's fiberd.json named.

mallory owns her job's state dir and so its ``fiberd.json``. She names, as her
fiberd's cgroup root, a tree that merely looks like Slurm's cgroup of her job
(``.../slurmstepd.scope/job_<id>/step_0``) but is not: a real cgroup v2 tree holding a
process of root's. Before the fix the epilog (the real console script, as slurmd runs
it) trusted any path of that shape and killed root's process. Now it kills only the
cgroups root derives itself (the site's delegated subtree, Slurm's root-owned v1
groups); the record's cgroup root is never used, and root's process lives on.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.homes.slurm.paths import job_paths
from tests.hooks.hookkit import Site, job_env, run_hook
from tests.security.publicdirkit import public_dir
from tests.security.userkit import JobUser, as_user

CGROUP2 = Path("/sys/fs/cgroup/unified")
JOB = 38400


@pytest.fixture
def site() -> Iterator[Site]:
    with public_dir() as scratch:
        yield Site(scratch / "site")


@pytest.fixture
def look_alike() -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A root-made cgroup v2 tree shaped like Slurm's cgroup of job JOB, with root's
    ``sleep`` in it."""
    if not os.access(CGROUP2 / "cgroup.procs", os.W_OK):
        pytest.skip(f"no writable cgroup v2 at {CGROUP2}")
    top = CGROUP2 / f"sf-test-{uuid.uuid4().hex[:8]}"
    step = top / "slurmstepd.scope" / f"job_{JOB}" / "step_0"
    step.mkdir(parents=True)
    victim = subprocess.Popen(["sleep", "300"])
    try:
        (step / "cgroup.procs").write_text(f"{victim.pid}\n")
        yield step, victim
    finally:
        victim.kill()
        victim.wait()
        for path in (step, step.parent, step.parent.parent, top):
            deadline = time.monotonic() + 5
            while path.exists():
                try:
                    path.rmdir()
                except OSError:
                    assert time.monotonic() < deadline, f"{path} stays populated"
                    time.sleep(0.05)


@pytest.mark.machine_may_lack("a writable cgroup v2 hierarchy")
def test_hostile_epilog_record_cgroup_a_look_alike_tree_is_never_killed(
        site: Site, mallory: JobUser,
        look_alike: tuple[Path, subprocess.Popen[bytes]]) -> None:
    step, victim = look_alike
    env = job_env(site, JOB, mallory.uid, mallory.gid, mallory.name)
    assert run_hook("prolog", env).returncode == 0
    state_dir = job_paths(site.state_root, "n1", JOB).state_dir
    record = {"pid": os.getpid(), "start": 0.0, "socket": "s", "cgroup_root": str(step),
              "uid": mallory.uid}  # any pid: the cgroup root is the claim
    as_user(mallory, f"printf '%s' '{json.dumps(record)}' > '{state_dir}/fiberd.json'")
    out = run_hook("epilog", env | {"SLURM_SCRIPT_CONTEXT": "epilog_slurmd"})
    assert out.returncode == 0, out.stderr
    time.sleep(0.2)
    assert victim.poll() is None, f"root's process in {step} was killed: {out.stderr}"
    assert str(step) not in out.stderr
