"""Finding (issue 38, low): the spool's 64-file cap counted dot-files.

A control plane that writes tokens as a careful writer does (a dot-named temporary file,
then a rename) can leave dot-files in a job's spool; they sort first, and 64 of them
filled the prolog's cap, so the job's real tokens were never read. Dot-files are now
passed over before the cap is applied. The real ``slurm-fiber-prolog`` runs as slurmd
runs it (hookkit).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurm_fiber.homes.slurm.paths import job_paths
from tests.hooks.hookkit import ISSUER, Site, job_env, run_hook
from tests.prolog.test_prolog_spool_hostile import token

if TYPE_CHECKING:
    from tests.security.userkit import JobUser


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path / "site")


def test_hostile_spool_dotfiles_do_not_count_against_the_cap(site: Site,
                                                             test_user: JobUser) -> None:
    spool = site.root / "spool"
    site.configure(f'spool_dir = "{spool}"')
    drop = spool / ISSUER / "48"
    drop.mkdir(parents=True)
    for n in range(80):
        (drop / f".cp-{n:03}.jwt.tmp").write_text("half written")
    (drop / "a-good.jwt").write_bytes(token(site.key, f"slurm:{ISSUER}:48"))
    out = run_hook("prolog", job_env(site, 48, test_user.uid, test_user.gid, test_user.name))
    assert (out.returncode, out.stderr) == (0, "")
    grants = job_paths(site.state_root, "n1", 48).grantdir
    assert sorted(p.name for p in grants.iterdir()) == ["job-48.jwt", "spool-a-good.jwt"]
