"""Strict shape checks for JSON records read from disk.

A record is a JSON object with known keys of known types. ``fields`` refuses
an unknown key, a missing required key or a wrong type with a ValueError
whose text names the key, so a caller can report one precise line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Kind = type | tuple[type, ...]
NUMBER: Kind = (int, float)


def fields(
    obj: Any, where: str, required: Mapping[str, Kind], optional: Mapping[str, Kind]
) -> dict[str, Any]:
    """Return ``obj`` as a dict after checking its keys and value types.

    ``bool`` never passes for a number. Raises ValueError naming ``where`` and
    the offending key; never returns a partially checked record.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where} is not a JSON object")
    known = {**required, **optional}
    for key in obj:
        if key not in known:
            raise ValueError(f"{where} has unknown field {key!r}")
    for key in required:
        if key not in obj:
            raise ValueError(f"{where} lacks field {key!r}")
    for key, value in obj.items():
        want = known[key]
        if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
            name = want.__name__ if isinstance(want, type) else "number"
            raise ValueError(f"{where} field {key!r} is not a {name}")
    return obj
