"""Finding (issue 38, low): ``keys gen`` made its directory 0700 where the docs say 0755.

docs/slurm.md puts the issuer's JWKS in /etc/slurm-fiber/keys (0755) because every
job's fiberd, running as the job user, must read it; ``keys gen`` made the directory
0700, so a job user's fiberd could not read its trust. The code now makes it 0755 (the
private key stays 0600, root's) and refuses an ``--out`` whose path another user could
change, where they could swap the key. Real processes of the real job user.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.publicdirkit import public_dir
from tests.security.userkit import JobUser

SLURM_FIBER = str(Path(sys.executable).parent / "slurm-fiber")


@pytest.fixture
def scratch() -> Iterator[Path]:
    with public_dir() as path:
        yield path


def keys_gen(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SLURM_FIBER, "keys", "gen", "--issuer", "site", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, umask=0o077)


def test_hostile_keys_gen_dir_lets_job_users_read_the_jwks_never_the_key(
        scratch: Path, mallory: JobUser) -> None:
    keys = scratch / "etc" / "keys"
    out = keys_gen(keys)
    assert out.returncode == 0, out.stderr
    assert keys.stat().st_mode & 0o777 == 0o755 and keys.parent.stat().st_mode & 0o777 == 0o755
    (key,) = keys.glob("site-*.key")
    reads = subprocess.run(["/bin/sh", "-c", f"cat '{keys}/site.jwks.json' >/dev/null && "
                                             f"! cat '{key}' 2>/dev/null"],
                           capture_output=True, text=True, timeout=30, **mallory.spawn_args())
    assert reads.returncode == 0, "mallory must read the JWKS and must not read the key"


def test_hostile_keys_gen_refuses_a_dir_another_user_can_change(scratch: Path,
                                                                mallory: JobUser) -> None:
    hers = scratch / "mallory"
    hers.mkdir()
    os.chown(hers, mallory.uid, mallory.gid)
    out = keys_gen(hers / "keys")
    assert out.returncode == 1 and "not safe for a signing key" in out.stderr, out.stderr
    assert not (hers / "keys").exists()
