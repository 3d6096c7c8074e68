"""Issue 38, low: a huge tree in the state dir defeated the epilog's removal and blocked the
next job with the same id.

mallory fills her job's state dir with a directory tree 3,000 deep, or with 200,000
files. Before the fix the epilog's ``rmtree`` failed (recursion) or overran its bound and
left the state dir, and the prolog of the next job with the same id (alice's, after a
job id reset) could not clear it: that job got no state dir and no token. Now the
epilog moves the state dir into the node's root-only retired area at once and removes
it there in bounded steps, and a prolog never depends on what was at the name: the
next job starts with fresh dirs, every epilog finishes within its bound (exit 0), and
later epilogs finish the removal. The hooks run as slurmd runs them (hookkit).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from slurm_fiber.homes.slurm.paths import job_paths
from tests.hooks.hookkit import Site, job_env, run_hook
from tests.security.publicdirkit import public_dir
from tests.security.userkit import JobUser

JOB = 38500
TREES = {
    "deep": "import os\nfor _ in range(3000):\n    os.mkdir('d'); os.chdir('d')\n",
    "wide": "import os\nos.mkdir('w'); os.chdir('w')\n"
            "for i in range(200000):\n    os.close(os.open(str(i), os.O_CREAT | os.O_WRONLY))\n",
}


@pytest.fixture
def site() -> Iterator[Site]:
    with public_dir() as scratch:
        yield Site(scratch / "site")
        subprocess.run(["rm", "-rf", str(scratch / "site")], check=False)  # deep trees too


@pytest.mark.parametrize("tree", sorted(TREES))
def test_hostile_epilog_state_tree_never_defeats_removal_or_blocks_the_next_job(
        site: Site, mallory: JobUser, alice: JobUser, tree: str) -> None:
    env = job_env(site, JOB, mallory.uid, mallory.gid, mallory.name)
    assert run_hook("prolog", env).returncode == 0
    paths = job_paths(site.state_root, "n1", JOB)
    subprocess.run(["/usr/bin/python3", "-c", TREES[tree]], cwd=paths.state_dir, check=True,
                   timeout=600, **mallory.spawn_args())
    out = run_hook("epilog", env | {"SLURM_SCRIPT_CONTEXT": "epilog_slurmd"}, timeout=120)
    assert out.returncode == 0 and "did not finish" not in out.stderr, out.stderr
    assert not paths.state_dir.exists(), out.stderr

    later = job_env(site, JOB, alice.uid, alice.gid, alice.name)  # the same id, reused
    out = run_hook("prolog", later)
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert [p.name for p in paths.grantdir.iterdir()] == [f"job-{JOB}.jwt"]
    assert paths.state_dir.stat().st_uid == alice.uid

    retired = site.state_root / "nodes" / "n1" / "retired"
    for _ in range(30):  # every epilog goes on with what earlier ones left, within its bound
        if not any(retired.iterdir()):
            break
        out = run_hook("epilog", job_env(site, JOB + 1, alice.uid, alice.gid, alice.name))
        assert out.returncode == 0 and "did not finish" not in out.stderr, out.stderr
    assert list(retired.iterdir()) == []
