"""Issue 38, critical: the prolog wrote the job's token through a link the job user swapped in.

mallory has a second job on the node. While the prolog of her next job runs (the real
console script, as slurmd runs it), a process of hers swaps the new job's ``grants/``
for a symlink to a root-owned directory the moment she can. Before the fix the prolog
handed her the state dir and the grantdir, then minted the token (tens of
milliseconds) and wrote ``job-<id>.jwt`` by path: root created a file of hers,
writable by her, in the root-owned directory. Now root makes and fills the dirs as its
own and hands them over last, so nothing root writes can land outside them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.homes.slurm.paths import job_paths
from tests.hooks.hookkit import Site, job_env, run_hook
from tests.security.publicdirkit import public_dir
from tests.security.userkit import JobUser

RACER = r"""
import os, sys, time
grants, victim, ready = sys.argv[1], sys.argv[2], sys.argv[3]
open(ready, "w").close()
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        os.rename(grants, grants + ".old")
    except OSError:
        continue
    os.symlink(victim, grants)
    print("swapped")
    break
"""


@pytest.fixture
def site() -> Iterator[Site]:
    with public_dir() as scratch:
        yield Site(scratch / "site")


def own_dir(site: Site, user: JobUser) -> Path:
    """A directory of ``user``'s own next to the site (for the racer's ready flag)."""
    path = site.root.parent / user.name
    path.mkdir(mode=0o700, exist_ok=True)
    os.chown(path, user.uid, user.gid)
    return path


def race_prolog(site: Site, mallory: JobUser, job_id: int, victim: Path) -> str:
    """Run the prolog of mallory's job ``job_id`` against her racer; what the racer said."""
    paths = job_paths(site.state_root, "n1", job_id)
    ready = own_dir(site, mallory) / f"ready-{job_id}"
    racer = subprocess.Popen(
        ["/usr/bin/python3", "-c", RACER, str(paths.grantdir), str(victim), str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **mallory.spawn_args())
    try:
        while not ready.exists():
            assert racer.poll() is None, "the racer did not start"
        out = run_hook("prolog", job_env(site, job_id, mallory.uid, mallory.gid, mallory.name))
        assert out.returncode == 0, out.stderr
    finally:
        try:
            said, _ = racer.communicate(timeout=40)
        finally:
            racer.kill()
    return said


def test_hostile_prolog_token_symlink_never_puts_roots_file_outside_the_grantdir(
        site: Site, mallory: JobUser) -> None:
    victim = site.root / "etc"  # a root-owned directory, like /etc
    victim.mkdir(mode=0o755)
    run_hook("prolog", job_env(site, 1, mallory.uid, mallory.gid, mallory.name))  # node dirs
    for job_id in (38001, 38002, 38003):
        said = race_prolog(site, mallory, job_id, victim)
        assert sorted(p.name for p in victim.iterdir()) == [], (
            f"job {job_id}: root wrote through mallory's link into {victim} (racer: {said!r})")
        grantdir = job_paths(site.state_root, "n1", job_id).grantdir
        placed = grantdir.with_name("grants.old") if said else grantdir
        assert (placed / f"job-{job_id}.jwt").is_file(), said
