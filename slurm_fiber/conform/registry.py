"""Stages by home name: the built-in ones, installed ones, or any importable factory.

``stage_factory(name)`` resolves, in order: a built-in stage
(``standalone``, ``kubernetes``, ``slurm``), a stage another package installs under the entry point
group ``slurm_fiber.conform_stages`` (name = factory), or ``module:attr``
naming a Stage class or factory directly (how a home author runs a stage
that is not installed). Unknown names raise ``UnknownStage`` with the names
that would work.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from slurm_fiber.conform.stage import StageFactory

ENTRY_POINT_GROUP = "slurm_fiber.conform_stages"
BUILTIN = {
    "standalone": "slurm_fiber.conform.standalone:StandaloneStage",
    "kubernetes": "slurm_fiber.conform.kubernetes:KubernetesStage",
    "slurm": "slurm_fiber.conform.slurm:SlurmStage",
}


class UnknownStage(LookupError):
    """No stage goes by that name (one line listing the known ones)."""


def known_homes() -> list[str]:
    """Names ``stage_factory`` resolves without a ``module:attr`` spec, sorted."""
    return sorted({*BUILTIN, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})


def _load(spec: str, name: str) -> StageFactory:
    module, _, attr = spec.partition(":")
    try:
        target: object = importlib.import_module(module)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as err:
        raise UnknownStage(f"stage {name!r}: cannot load {spec}: {err}") from None
    if not callable(target):
        raise UnknownStage(f"stage {name!r}: {spec} is not a Stage class or factory")
    return target


def stage_factory(name: str) -> StageFactory:
    """The factory of the stage called ``name``; raises UnknownStage. Imports it on demand."""
    if name in BUILTIN:
        return _load(BUILTIN[name], name)
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
        return _load(ep.value, name)
    if ":" in name:
        return _load(name, name)
    raise UnknownStage(f"no conformance stage for home {name!r}; known: "
                       f"{', '.join(known_homes())} (or give module:StageFactory)")
