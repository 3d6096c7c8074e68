"""The home registry: every home fiberd can run in, by name, and how each is built.

One ``HomeEntry`` per home says everything the rest of slurm_fiber needs to
know about it: its ``name`` (what ``--home`` takes), a one-line ``summary``
and the fiberd ``options`` it reads (for ``fiberd --help``), ``defaults``
(options the environment implies, e.g. a Slurm job's state dir), ``claims``
(whether an environment is this home's, so ``fiberd-run`` picks it), its
conformance ``stage``, and ``build``, which returns a ``BuiltHome``: the
``Home`` the core runs plus everything fiberd's wiring needs from the home
(audience, why its cgroup root is what it is, what to announce and withdraw,
how to close it). So nothing about a home is found by probing it.

The built-in homes are listed in ``slurm_fiber.homes.builtin``; another
package adds one with an entry point in the group ``slurm_fiber.homes``
whose value names a ``HomeEntry`` (``example = "mypkg.home:HOME"``). A
built-in name wins over an installed one. An unknown name is refused with
``UnknownHome``, one line listing the known homes. Looking up a built-in
home reads no package metadata; listing every home scans the installed
entry points once per process (and then only when asked).

Each home's own modules are imported inside its ``build``, so fiberd loads
only the home it runs (no Kubernetes client in a Slurm job) and this module
stays importable by every option parser.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurm_fiber.config import FiberdConfig, Option
    from slurm_fiber.core.clock import Clock
    from slurm_fiber.core.seam import Home
    from slurm_fiber.homes.problem import ProblemSink

ENTRY_POINT_GROUP = "slurm_fiber.homes"


class HomeRefused(Exception):
    """The configured home cannot be built here (one line naming what is missing)."""


class UnknownHome(HomeRefused):
    """No home goes by that name, or an installed one cannot be loaded (one line)."""


def _nothing(*_: object) -> None:
    """For homes that announce nothing."""


async def _close_nothing() -> list[str]:
    """For homes whose building left nothing to undo."""
    return []


@dataclass
class BuiltHome:
    """A built home: the ``Home`` the core runs and what fiberd's wiring needs from it.

    ``audience`` is the ``aud`` its tokens must name. ``announce(socket)``
    is called once fiberd listens (the Slurm home leaves its record for
    fiberctl and the epilog), ``withdraw()`` when it stops; ``close()``
    undoes what building did (cgroup delegation, API clients), last, never
    raising, one line per failure. ``cgroup_reason()`` says in one line why
    ``home.cgroup_root()`` is what it is; fiberd calls it after
    ``cgroup_root()``, which may resolve the root on first use.
    """

    home: Home
    audience: str
    announce: Callable[[Path], None] = dataclasses.field(default=_nothing, repr=False)
    withdraw: Callable[[], None] = dataclasses.field(default=_nothing, repr=False)
    close: Callable[[], Awaitable[list[str]]] = dataclasses.field(default=_close_nothing,
                                                                   repr=False)
    cgroup_reason: Callable[[], str] | None = dataclasses.field(default=None, repr=False)

    def replaced(self, **changes: Any) -> BuiltHome:
        """A copy with ``changes`` (field name -> new value): ``dataclasses.replace``."""
        return dataclasses.replace(self, **changes)

    def cgroup_line(self) -> str:
        """``cgroup_reason()``, or a line saying the home gives no cgroup root."""
        if self.cgroup_reason is not None:
            return self.cgroup_reason()
        return f"the {self.home.name()} home gives no cgroup root"


# ``build(config, clock, environ, on_problem)``: blocks briefly (file reads in threads);
# raises HomeRefused with one line when the home cannot be built here.
HomeBuilder = Callable[["FiberdConfig", "Clock", Mapping[str, str], "ProblemSink"],
                       Awaitable[BuiltHome]]


def _no_defaults(_environ: Mapping[str, str]) -> dict[str, object]:
    return {}


def _never(_environ: Mapping[str, str]) -> bool:
    return False


@dataclass(frozen=True)
class HomeEntry:
    """One home in the registry. Every callable but ``build`` is pure or reads small files.

    ``defaults(environ)`` returns fiberd options the home implies (option
    name to value, below the file, environment and flags; raises HomeRefused
    when the environment is not the home's). ``claims(environ)``: whether
    ``fiberd-run`` without ``--home`` should pick this home. ``stage``:
    ``module:attr`` of its grant-conform Stage factory, None when it has none.
    ``own_options``: ``module:attr`` of the tuple of ``config.Option`` the home
    declares for itself (loaded only when fiberd's options are, ``home_options``),
    None when it has none.
    """

    name: str
    summary: str
    build: HomeBuilder = dataclasses.field(repr=False)
    options: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    defaults: Callable[[Mapping[str, str]], dict[str, object]] = dataclasses.field(
        default=_no_defaults, repr=False)
    claims: Callable[[Mapping[str, str]], bool] = dataclasses.field(default=_never, repr=False)
    stage: str | None = dataclasses.field(default=None, repr=False)
    own_options: str | None = dataclasses.field(default=None, repr=False)


def builtin_entries() -> tuple[HomeEntry, ...]:
    """The homes slurm_fiber ships, in the order fiberd-run asks them."""
    from slurm_fiber.homes.builtin import BUILTIN

    return BUILTIN


_INSTALLED: list[tuple[tuple[str, str], ...]] = []  # _installed()'s one answer, once read


def _installed() -> tuple[tuple[str, str], ...]:
    """(name, value) of every ``slurm_fiber.homes`` entry point, read once per process."""
    if not _INSTALLED:
        _INSTALLED.append(tuple(sorted(
            (ep.name, ep.value) for ep in entry_points(group=ENTRY_POINT_GROUP))))
    return _INSTALLED[0]


def forget_installed() -> None:
    """Read the entry points again on next use (after installing a home at run time)."""
    _INSTALLED.clear()


def load_object(spec: str) -> object:
    """The object ``module:attr`` (attr may be dotted) names, importing the module.

    Raises LookupError with one line when it cannot be had.
    """
    module, _, attr = spec.partition(":")
    try:
        target: object = importlib.import_module(module)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as err:
        raise LookupError(f"cannot load {spec}: {err}") from None
    return target


def _load(name: str, spec: str) -> HomeEntry:
    try:
        target = load_object(spec)
    except LookupError as err:
        raise UnknownHome(f"home {name!r}: {err}") from None
    if not isinstance(target, HomeEntry):
        raise UnknownHome(f"home {name!r}: {spec} is not a HomeEntry")
    if target.name != name:
        raise UnknownHome(f"home {name!r}: {spec} is the entry of {target.name!r}")
    return target


def names() -> list[str]:
    """Every known home's name: the built-ins in order, then the installed ones, sorted."""
    builtin = [entry.name for entry in builtin_entries()]
    return [*builtin, *(name for name, _ in _installed() if name not in builtin)]


def lookup(name: str) -> HomeEntry:
    """The entry of the home called ``name``; raises UnknownHome (one line) otherwise."""
    for entry in builtin_entries():
        if entry.name == name:
            return entry
    for installed, spec in _installed():
        if installed == name:
            return _load(name, spec)
    near = difflib.get_close_matches(name, names(), n=1)
    hint = f"; did you mean {near[0]}?" if near else ""
    raise UnknownHome(f"no home named {name!r} (known: {', '.join(names())}){hint}")


def each_entry() -> Iterator[HomeEntry]:
    """Every home's entry, lazily in ``names()`` order (the installed ones are scanned
    only once the built-ins are exhausted), skipping an installed one that cannot be
    loaded (``lookup`` of its name says why)."""
    yield from builtin_entries()
    for name in names()[len(builtin_entries()):]:
        try:
            yield lookup(name)
        except UnknownHome:
            continue


def home_options() -> tuple[Option, ...]:
    """Every known home's own options (``HomeEntry.own_options``), in ``names()`` order,
    each name once (the first home's declaration wins); a declaration that cannot be
    loaded is skipped (``slurm-fiber conform`` of that home says why)."""
    seen: dict[str, Option] = {}
    for entry in each_entry():
        if entry.own_options is None:
            continue
        try:
            declared = load_object(entry.own_options)
        except LookupError:
            continue
        for opt in declared if isinstance(declared, tuple) else ():
            seen.setdefault(opt.name, opt)
    return tuple(seen.values())


def load_config(path: str | None = None, env: Mapping[str, str] | None = None,
                flags: Mapping[str, object] | None = None, **kw: Any) -> FiberdConfig:
    """``config.load_config`` knowing every home's own options (``home_options``): how
    fiberd, its tests and the stages load a configuration that may name them."""
    from slurm_fiber import config

    return config.load_config(path, env, flags, home_options=home_options(), **kw)


def claiming(environ: Mapping[str, str], fallback: str = "standalone") -> str:
    """The name of the first home (``each_entry`` order) that claims ``environ``, else
    ``fallback``. Blocks only on what the entries' ``claims`` read (env only, built-in)."""
    return next((entry.name for entry in each_entry() if entry.claims(environ)), fallback)


def home_defaults(home: str, environ: Mapping[str, str]) -> dict[str, object]:
    """Options the home implies, below the file, environment and flags.

    Raises UnknownHome for a name no home has, HomeRefused when the
    environment is not the home's (the Slurm home outside a job).
    """
    return lookup(home).defaults(environ)


async def build_home(config: FiberdConfig, clock: Clock, environ: Mapping[str, str],
                     on_problem: ProblemSink) -> BuiltHome:
    """Build the home ``config.home`` names (see ``HomeEntry.build``). Raises HomeRefused."""
    return await lookup(config.home).build(config, clock, environ, on_problem)


async def close_home(built: BuiltHome) -> list[str]:
    """Withdraw the announcement and undo what building the home did; one line per
    failure. Never raises."""
    try:
        built.withdraw()
        return list(await built.close())
    except Exception as err:
        return [f"closing the {built.home.name()} home failed: {err}"]
