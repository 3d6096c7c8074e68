"""The grant as the core sees it: what a verified token says.

``VerifiedToken`` is the output of token verification (signature, algorithm,
issuer, audience and claim shapes already checked); ``FiberSpec`` is the
token's ``fiber`` claim parsed into typed, validated fields. Both are
immutable values: the core's decisions and the process layer read them and
never change them. ``ScopeClaim`` is one thing a home asserts about where it
runs (stamped on audit records, never a validity term).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from slurm_fiber.protocol.names import valid_uid as valid_uid


@dataclass(frozen=True)
class TemplateSpec:
    """How to warm the grant's template: modules to import, a warm hook, env to set."""

    preload: tuple[str, ...] = ()
    warm: str | None = None  # "module:function"
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Limits:
    """Resource limits; None means unlimited / not set."""

    fibers: int | None = None  # max concurrent fibers
    memory: int | None = None  # bytes, per grant cgroup
    pids: int | None = None  # per grant cgroup
    cpu: float | None = None  # CPUs (cpu.max quota / period)
    seconds: float | None = None  # per-fiber wall-time limit


@dataclass(frozen=True)
class FiberSpec:
    """The token's ``fiber`` claim: template, limits and device kinds it may drive."""

    template: TemplateSpec = field(default_factory=TemplateSpec)
    limits: Limits = field(default_factory=Limits)
    devices: tuple[str, ...] = ()  # device kinds, e.g. ("gpu",)


@dataclass(frozen=True)
class VerifiedToken:
    """A token whose signature and claims were checked; times are Unix seconds.

    ``leeway_used`` is how many seconds of leeway the nbf/iat checks needed
    (0 when none), recorded in the audit log.
    """

    uid: str
    issuer: str
    jti: str
    audience: tuple[str, ...]
    exp: float
    iat: float
    nbf: float | None
    spec: FiberSpec
    raw: bytes
    leeway_used: float = 0.0


@dataclass(frozen=True)
class ScopeClaim:
    """One fact a home asserts about where it runs, e.g. ("slurm.job_id", "42")."""

    key: str
    value: str
