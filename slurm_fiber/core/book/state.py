"""The grant book's durable state: epoch, admitted tokens, denials, expiry horizons.

``BookState`` is a plain value the decisions in ``decisions.py`` read and
replace. ``StateFile`` persists it as one JSON document, written atomically
(a 0600 temporary file in the same directory, fsync, rename, fsync of the
directory), so a crash leaves either the old or the new state, never a mix,
and a restart that reloads it makes exactly the decisions the old process
would have. Deadlines are kept on the monotonic clock (CLOCK_BOOTTIME), which
is only meaningful within one boot: the file records the boot id, and a state
saved under another boot is rebased from the tokens' Unix times once, at load.
A file that exists but cannot be read as a state is never silently reset (that
would reuse epochs and forget denials): ``load`` raises ``StateCorrupt`` with a
one-line reason naming the file. Saves may come from the loop and from a
worker thread at once: each is stamped (``stamp``) when its state is taken,
and ``write`` never replaces a newer stamp's state with an older one.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from slurm_fiber.core.clock import Clock
from slurm_fiber.core.fibers.spec import BadFiberClaim, fiber_spec_to_json, parse_fiber_spec
from slurm_fiber.core.trust.grant import FiberSpec
from slurm_fiber.safefs import replace_file

FORMAT = "slurm_fiber.grantbook/1"
BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Horizon:
    """A point in time kept on both scales: Unix seconds (for people) and monotonic (to decide)."""

    wall: float
    mono: float

    @classmethod
    def at_wall(cls, wall: float, clock: Clock) -> Horizon:
        """Convert a Unix time to the monotonic scale, once, at the clock's now."""
        return cls(wall, clock.mono() + (wall - clock.wall()))

    def later(self, other: Horizon | None) -> Horizon:
        return self if other is None or self.mono >= other.mono else other


@dataclass(frozen=True)
class HeldToken:
    """An admitted token: its id, issuer, times and grant. ``expiry`` was converted at admission."""

    jti: str
    issuer: str
    iat: float
    expiry: Horizon
    spec: FiberSpec


@dataclass
class BookState:
    """Everything the grant book decides from. ``clone()`` copies it for a new version."""

    epoch: int = 0
    epoch_reason: str = ""
    tokens: dict[str, dict[str, HeldToken]] = field(default_factory=dict)  # uid → jti → token
    denials: dict[str, Horizon] = field(default_factory=dict)  # uid → denied until
    seen: dict[str, Horizon] = field(default_factory=dict)  # uid → latest exp ever seen

    def clone(self) -> BookState:
        return replace(
            self,
            tokens={uid: dict(held) for uid, held in self.tokens.items()},
            denials=dict(self.denials),
            seen=dict(self.seen),
        )

    def rebased(self, clock: Clock) -> BookState:
        """Every monotonic reading recomputed from its Unix time (after a reboot)."""
        def again(h: Horizon) -> Horizon:
            return Horizon.at_wall(h.wall, clock)

        return replace(
            self,
            tokens={
                uid: {j: replace(t, expiry=again(t.expiry)) for j, t in held.items()}
                for uid, held in self.tokens.items()
            },
            denials={uid: again(h) for uid, h in self.denials.items()},
            seen={uid: again(h) for uid, h in self.seen.items()},
        )


class StateCorrupt(Exception):
    """The state file exists but is not a valid state; ``str(err)`` names the file."""


def current_boot_id() -> str:
    """This boot's id from the kernel ("" where the kernel does not offer one)."""
    try:
        return BOOT_ID_FILE.read_text().strip()
    except OSError:
        return ""


class StateFile:
    """Where a GrantBook keeps its state. ``save`` blocks on fsync; call it off hot loops."""

    def __init__(self, path: str | os.PathLike[str], boot_id: str | None = None) -> None:
        self.path = Path(path)
        self.boot_id = current_boot_id() if boot_id is None else boot_id
        self._stamps = itertools.count(1)
        self._written = 0  # the stamp of the state on disk
        self._lock = threading.Lock()

    def load(self, clock: Clock) -> BookState | None:
        """The saved state (rebased if saved under another boot); None when there is no file.

        Raises StateCorrupt for an unreadable or invalid file.
        """
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise StateCorrupt(f"{self.path}: cannot read grant state: {err.strerror}") from None
        try:
            doc = json.loads(data)
            state = _from_json(doc)
        except (ValueError, TypeError, KeyError, AttributeError, BadFiberClaim) as err:
            raise StateCorrupt(
                f"{self.path}: corrupt grant state ({err.__class__.__name__}: {err}); "
                "fiberd will not start over it, since that would reuse epochs and forget denials"
            ) from None
        return state if doc.get("boot_id") == self.boot_id else state.rebased(clock)

    def save(self, state: BookState) -> None:
        """Replace the file atomically with ``state``. Raises OSError when it cannot."""
        self.write(self.stamp(), state)

    def stamp(self) -> int:
        """A stamp for a state taken now (call where the state is taken, on its loop)."""
        return next(self._stamps)

    def write(self, stamp: int, state: BookState) -> None:
        """``save`` of a state stamped earlier; thread-safe. A state older than the one on
        disk is not written (it is already contained). Raises OSError when it cannot."""
        data = json.dumps(_to_json(state, self.boot_id), separators=(",", ":")).encode()
        with self._lock:
            if stamp < self._written:
                return
            replace_file(self.path, data, mode=0o600)
            self._written = stamp


def _horizon_json(h: Horizon) -> list[float]:
    return [h.wall, h.mono]


def _horizon(v: Any) -> Horizon:
    wall, mono = v
    return Horizon(_num(wall), _num(mono))


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"expected a number, got {v!r:.40}")
    return float(v)


def _to_json(state: BookState, boot_id: str) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "boot_id": boot_id,
        "epoch": state.epoch,
        "epoch_reason": state.epoch_reason,
        "tokens": {
            uid: [
                {"jti": t.jti, "iss": t.issuer, "iat": t.iat,
                 "expiry": _horizon_json(t.expiry), "fiber": fiber_spec_to_json(t.spec)}
                for t in held.values()
            ]
            for uid, held in state.tokens.items()
        },
        "denials": {uid: _horizon_json(h) for uid, h in state.denials.items()},
        "seen": {uid: _horizon_json(h) for uid, h in state.seen.items()},
    }


def _from_json(doc: Any) -> BookState:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} document")
    epoch = doc["epoch"]
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError("epoch is not a non-negative integer")
    tokens: dict[str, dict[str, HeldToken]] = {}
    for uid, held in doc["tokens"].items():
        tokens[uid] = {}
        for t in held:
            if not isinstance(t["jti"], str) or not isinstance(t["iss"], str):
                raise TypeError("token jti/iss must be strings")
            tokens[uid][t["jti"]] = HeldToken(
                t["jti"], t["iss"], _num(t["iat"]), _horizon(t["expiry"]),
                parse_fiber_spec(t["fiber"], floors=False),
            )
    return BookState(
        epoch=epoch,
        epoch_reason=str(doc["epoch_reason"]),
        tokens=tokens,
        denials={uid: _horizon(h) for uid, h in doc["denials"].items()},
        seen={uid: _horizon(h) for uid, h in doc["seen"].items()},
    )
