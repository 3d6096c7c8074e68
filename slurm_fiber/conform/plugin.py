"""grant-conform as a pytest plugin: ``pytest --conform-home NAME`` adds one test per clause.

Installed through the ``pytest11`` entry point, it does nothing unless
``--conform-home`` is given, so a test run that does not ask for it is
unchanged. With it, pytest gains one item per contract clause, named
``conform[HOME]::CLAUSE`` (select with ``-k``, e.g. ``-k 'conform and
removal'``). NAME is what ``slurm-fiber conform --home`` takes: a registered
home or ``module:StageFactory``, so a home author runs the same clauses
under pytest against their own Stage.

The selected clauses run once, together, when the first of their items runs
(one stage opened, one event loop); each item then reports its clause:
passed, failed with the clause's one-line reason, or skipped with the
stage's declared reason. An undeclared skip is a skip, or a failure with
``--conform-strict``. A stage that cannot be opened fails every item.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

# conform's own modules are imported inside the hooks below, on purpose: pytest loads
# this plugin (entry point pytest11) in every test run, which must not pay for them.
if TYPE_CHECKING:
    from slurm_fiber.conform.clauses import Clause
    from slurm_fiber.conform.report import Report

_REPORT = pytest.StashKey["Report | str"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("grant-conform", "grant-conform: the home conformance suite")
    group.addoption("--conform-home", default=None, metavar="NAME",
                    help="run the conformance clauses against this home's stage "
                         "(a registered name or module:StageFactory)")
    group.addoption("--conform-strict", action="store_true", default=False,
                    help="fail clauses a stage skipped without declaring it")


class ConformFailure(Exception):
    """A clause failed; its message is the clause's one-line reason."""


class ConformItem(pytest.Item):
    """One contract clause against the home named by ``--conform-home``."""

    def __init__(self, *, clause: Clause, home: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clause = clause
        self.home = home

    def runtest(self) -> None:
        from slurm_fiber.conform.report import Outcome

        report = _report(self)
        if isinstance(report, str):
            raise ConformFailure(report)
        result = next(r for r in report.results if r.clause == self.clause.name)
        if result.outcome is Outcome.FAIL:
            raise ConformFailure(result.reason)
        if result.outcome is Outcome.UNDECLARED_SKIP and report.strict:
            raise ConformFailure(f"undeclared skip (strict): {result.reason}")
        if result.outcome is not Outcome.PASS:
            pytest.skip(f"{result.outcome.value}: {result.reason}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str:
        if isinstance(excinfo.value, ConformFailure):
            return f"{self.clause.name}: {excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "grant-conform", None, f"conform[{self.home}]::{self.clause.name}"


def _report(item: ConformItem) -> Report | str:
    """The run's report (running the selected clauses on first use), or why it could not run."""
    stash = item.config.stash
    if _REPORT not in stash:
        stash[_REPORT] = _run(item)
    return stash[_REPORT]


def _run(item: ConformItem) -> Report | str:
    import asyncio

    from slurm_fiber.conform.registry import stage_factory
    from slurm_fiber.conform.runner import run_suite

    chosen = [i.clause for i in item.session.items if isinstance(i, ConformItem)]
    strict = bool(item.config.getoption("conform_strict"))
    try:
        stage = stage_factory(item.home)()
        return asyncio.run(run_suite(stage, chosen, strict=strict))
    except Exception as err:
        return f"the {item.home} stage could not run: {type(err).__name__}: {err}"


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection, so it applies to these items
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    home = config.getoption("conform_home")
    if not home:
        return
    from slurm_fiber.conform.clauses import CLAUSES

    items.extend(ConformItem.from_parent(session, name=f"conform[{home}]::{clause.name}",
                                         clause=clause, home=home) for clause in CLAUSES)
