"""The Stage protocol: what a home provides so grant-conform can drive it.

A stage builds one home's environment (temporary directories, a fake or real
control plane), tells the harness how fiberd is configured there, and gives
it the levers a control plane has over the home: deliver a grant, remove it,
silence and restore the control plane, lose scope, and read what the control
plane sees (published readiness, held devices). The harness itself plays the
issuer: it hands the stage an ``Issuer`` to trust and mints every token.

A stage declares the ``Capability`` levers it lacks, each with a reason
(``lacks``). A clause that needs a lever the stage lacks is reported as a
*declared* skip giving that reason, never run and never passed. A lever that fails at run time for a
reason the stage could not know in advance raises ``StageCannot``: the
clause is reported as an *undeclared* skip (``--strict`` counts it as a
failure). See docs/conform.md for how to write a stage.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

from slurm_fiber.config import FiberdConfig
from slurm_fiber.core.devices import Device
from slurm_fiber.daemon import HomeBuilder
from slurm_fiber.homes.select import build_home


class Capability(enum.StrEnum):
    """A lever a stage may have; each clause names the ones it needs."""

    # silence() / restore(): the home has a control plane whose silence makes
    # its SourceHealth stale (and which the harness can stop answering).
    CONTROL_PLANE = "control_plane"
    # lose_scope(): the home has a scope and the stage can make it lose it.
    SCOPE = "scope"
    # devices(): the home provisions devices a grant can name.
    DEVICES = "devices"
    # held_devices(): the control plane can see which devices are claimed.
    DEVICE_HOLDS = "device_holds"


class StageCannot(Exception):
    """A lever cannot work here, for a reason found at run time (one line).

    The clause becomes an undeclared skip. Declare the capability missing
    instead whenever the stage knows in advance.
    """


@dataclass(frozen=True)
class Issuer:
    """The issuer the harness mints with: fiberd must trust ``name`` with ``jwks``."""

    name: str
    jwks: Path


_T = TypeVar("_T")


def while_open(value: _T | None) -> _T:
    """``value``, set by a stage's ``open``; RuntimeError while it is None (not open)."""
    if value is None:
        raise RuntimeError("the stage is not open")
    return value


class OpenedStage:
    """What every built-in stage keeps from ``open`` to ``close``: its work dir and the
    harness's issuer. A base for stages; the harness does not require it."""

    def __init__(self) -> None:
        self._root: Path | None = None
        self._issuer: Issuer | None = None

    def opened(self, workdir: Path, issuer: Issuer) -> None:
        """Record what ``open`` was given (call it first thing in ``open``)."""
        self._root, self._issuer = workdir, issuer

    @property
    def root(self) -> Path:
        """The stage's work dir; RuntimeError before ``open``."""
        return while_open(self._root)

    @property
    def trust(self) -> str:
        """fiberd's ``trust`` value naming the harness's issuer; RuntimeError before ``open``."""
        issuer = while_open(self._issuer)
        return f"{issuer.name}={issuer.jwks}"


@dataclass(frozen=True)
class Launch:
    """How fiberd starts in this stage: exactly as ``fiberd`` would, with ``build``.

    ``config`` must trust the harness's issuer and keep state in a directory
    the stage owns. ``environ`` is the environment fiberd reads (a Slurm
    job's variables, ...). ``build`` builds the home; leave the default (the
    configured home, as the ``fiberd`` command builds it) unless the stage
    tests a modified home.
    """

    config: FiberdConfig
    environ: Mapping[str, str]
    build: HomeBuilder = build_home


@dataclass(frozen=True)
class Published:
    """What the home's control plane sees of readiness.

    ``current`` is the state it holds now (a file, a Pod condition, a job
    comment; None: nothing published yet). ``history`` is every state it was
    sent, in order, since the stage was opened; a stage that can only sample
    gives its samples (repeats allowed, missed flips undetectable).
    """

    current: bool | None
    history: tuple[bool, ...]


@runtime_checkable
class Stage(Protocol):
    """One home, as grant-conform drives it. All methods run on the harness's event loop.

    Lifecycle: ``open`` once, then for each clause the harness starts fiberd
    from ``launch()``, pulls levers, and stops fiberd; ``close`` once at the
    end (also after a failure). Lever methods return once the control plane
    holds the change; fiberd notices it on its own (the harness waits for
    that, bounded). Levers of a capability in ``lacks`` are never called and
    may raise NotImplementedError; ``deliver``, ``remove``, ``launch`` and
    ``readiness`` every stage has.
    """

    home: str  # the name ``fiberd --home`` takes
    # Every capability this stage lacks, with one line saying why (shown in the report).
    lacks: Mapping[Capability, str]

    async def open(self, workdir: Path, issuer: Issuer) -> None:
        """Build the environment under ``workdir`` (empty, owned by the harness)."""
        ...

    async def close(self) -> None:
        """Undo ``open``: stop what it started. Never raises."""
        ...

    def launch(self) -> Launch:
        """fiberd's configuration, environment and home builder (called per clause)."""
        ...

    async def deliver(self, uid: str, token: str) -> None:
        """Make the control plane hold ``token`` for ``uid`` (replacing an earlier one)."""
        ...

    async def remove(self, uid: str) -> None:
        """Make the control plane stop holding any grant for ``uid``."""
        ...

    async def silence(self) -> None:
        """CONTROL_PLANE: make the control plane stop answering the home."""
        ...

    async def restore(self) -> None:
        """CONTROL_PLANE: make it answer again."""
        ...

    async def lose_scope(self) -> None:
        """SCOPE: make the home lose its scope (may be irreversible; run last)."""
        ...

    def readiness(self) -> Published:
        """What the control plane sees of the home's readiness now. Never blocks."""
        ...

    def devices(self) -> tuple[Device, ...]:
        """DEVICES: every device the home provisions to a grant naming every kind."""
        ...

    def held_devices(self) -> frozenset[Device]:
        """DEVICE_HOLDS: devices the control plane sees claimed now."""
        ...


StageFactory = Callable[[], Stage]


def missing_members(obj: object) -> list[str]:
    """The ``Stage`` attributes and methods ``obj`` lacks, in the protocol's order."""
    members = [*Stage.__annotations__,
               *(name for name, value in vars(Stage).items()
                 if callable(value) and not name.startswith("_"))]
    return [name for name in members if not hasattr(obj, name)]
