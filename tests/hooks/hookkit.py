"""Shared by the prolog and epilog tests: a site (key, JWKS, config) in a tmp dir, a job's
hook environment, and `env -i` runs of the real console scripts as slurmd runs them."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from slurm_fiber.core.trust.mint import save_private_key
from slurm_fiber.testing import Issuer

VENV_BIN = Path(sys.executable).parent
ISSUER = "citest"


def open_up(path: Path) -> None:
    """Make ``path`` and its parents traversable by every user (the job user must reach it)."""
    path.chmod(0o755)
    for parent in path.parents:
        if parent.stat().st_mode & 0o011 != 0o011:
            parent.chmod(parent.stat().st_mode | 0o011)


@dataclass
class Site:
    """A site under ``root``: issuer key and JWKS, and a config written by ``configure``."""

    root: Path
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        open_up(self.root)
        (self.root / "keys").mkdir(mode=0o700, exist_ok=True)
        issuer = Issuer(ISSUER, self.root / "site.jwks.json")
        self.key, self.jwks = issuer.key, issuer.jwks
        self.key_path = self.root / "keys" / "site.key"
        if not self.key_path.exists():
            save_private_key(self.key, self.key_path)
        self.state_root = self.root / "state"
        self.config = self.root / "site.toml"
        self.configure()

    def configure(self, *extra: str, trust: bool = True) -> Path:
        """Write the site config: issuer, key, state root, ``extra`` top-level lines."""
        lines = [f'issuer = "{ISSUER}"', f'issuer_key = "{self.key_path}"',
                 f'state_root = "{self.state_root}"', *extra]
        if trust:
            lines += ["[trust]", f'{ISSUER} = "{self.jwks}"']
        lines += ["[grant]", 'devices = ["gpu"]', "limits = { fibers = 2 }"]
        self.config.write_text("\n".join(lines) + "\n")
        return self.config


def job_env(site: Site, job_id: int, uid: int, gid: int, user: str, *, node: str = "n1",
            gpus: str | None = None, **more: str) -> dict[str, str]:
    """What slurmd gives a prolog/epilog for a job (22.05), plus the site config variable."""
    env = {"SLURM_FIBER_CONFIG": str(site.config), "SLURM_JOB_ID": str(job_id),
           "SLURM_JOBID": str(job_id), "SLURM_JOB_UID": str(uid), "SLURM_JOB_GID": str(gid),
           "SLURM_JOB_USER": user, "SLURM_JOB_PARTITION": "debug", "SLURMD_NODENAME": node,
           "SLURM_CLUSTER_NAME": ISSUER, "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}
    if gpus is not None:
        env |= {"SLURM_JOB_GPUS": gpus, "CUDA_VISIBLE_DEVICES": gpus}
    return env | more


def run_hook(kind: str, env: dict[str, str], *args: str,
             as_user: tuple[int, int] | None = None, umask: int = 0o022,
             timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run slurm-fiber-<kind> under `env -i` with exactly ``env`` (no PATH, no HOME),
    as root or as ``as_user`` (uid, gid), with ``umask``."""
    argv = ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()),
            str(VENV_BIN / f"slurm-fiber-{kind}"), *args]
    ids = {} if as_user is None else {"user": as_user[0], "group": as_user[1],
                                      "extra_groups": []}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, umask=umask,
                          **ids)


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
