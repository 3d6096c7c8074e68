"""The Slurm home's light types: its settings and its device refusal.

``SlurmHomeConfig`` (with ``health_poll_every``) and ``DevicesRefused`` are
what the site config (siteconfig) and the node's device leases (leases)
share with the home. They live apart from home.py, which pulls in asyncio
and jwt, so the prolog and epilog import them at no cost and neither module
needs a function-local import of the home. Pure; nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slurm_fiber.errors import CodedError
from slurm_fiber.homes.slurm.paths import DEFAULT_STATE_ROOT


class DevicesRefused(CodedError):
    """The grant's devices cannot be had: ``code`` (device_held, lease_failed) and ``reason``."""


@dataclass(frozen=True)
class SlurmHomeConfig:
    """Settings of the Slurm home; every field has a working default.

    ``poll_every`` is the HealthPoll interval (and each round's budget),
    ``stale_after`` the health's stale TTL, ``grant_poll_every`` the grantdir
    interval, ``publish_comment`` also writes readiness to the job's Comment,
    ``gpu_files`` maps a node GPU index to its device file (gres.gpu_files).
    """

    state_root: Path = DEFAULT_STATE_ROOT
    poll_every: float = 5.0
    stale_after: float = 30.0
    grant_poll_every: float = 1.0
    publish_comment: bool = False
    gpu_files: Mapping[int, str] = field(default_factory=dict)


def health_poll_every(stale_after: float) -> float:
    """The HealthPoll interval for a stale TTL of ``stale_after`` s: the default, or a third
    of the TTL when that is shorter, so a control plane that answers every round never reads
    stale between two rounds (one slow round is absorbed too). Pure."""
    return min(SlurmHomeConfig.poll_every, stale_after / 3)
