"""Stages by home name: each home's own stage from the home registry, or any importable factory.

``stage_factory(name)`` resolves, in order: the stage the home registry's
entry for ``name`` names (``HomeEntry.stage``: the built-in homes and every
home installed under the ``slurm_fiber.homes`` entry point group), or
``module:attr`` naming a Stage class or factory directly (how a home author
runs a stage that is not registered). Unknown names raise ``UnknownStage``
with the names that would work.
"""

from __future__ import annotations

from slurm_fiber.conform.stage import StageFactory
from slurm_fiber.homes.select import UnknownHome, each_entry, load_object, lookup


class UnknownStage(LookupError):
    """No stage goes by that name (one line listing the known ones)."""


def known_homes() -> list[str]:
    """Homes with a stage ``stage_factory`` resolves by name, in the registry's order."""
    return [entry.name for entry in each_entry() if entry.stage]


def _load(spec: str, name: str) -> StageFactory:
    try:
        target = load_object(spec)
    except LookupError as err:
        raise UnknownStage(f"stage {name!r}: {err}") from None
    if not callable(target):
        raise UnknownStage(f"stage {name!r}: {spec} is not a Stage class or factory")
    return target


def stage_factory(name: str) -> StageFactory:
    """The factory of the stage called ``name``; raises UnknownStage. Imports it on demand."""
    if ":" in name:
        return _load(name, name)
    try:
        entry = lookup(name)
    except UnknownHome as err:
        raise UnknownStage(f"no conformance stage for home {name!r}: {err} "
                           "(or give module:StageFactory)") from None
    if entry.stage is None:
        raise UnknownStage(f"the {name} home registers no conformance stage; known: "
                           f"{', '.join(known_homes())} (or give module:StageFactory)")
    return _load(entry.stage, name)
