"""fiberd's memory budget: the one place where fiberd's code is shaped by its memory.

fiberd lives as long as its job, one per job and node, so its proportional set size
(PSS) is paid by every job. The budget is ``PSS_BUDGET_MB`` for a fiberd with one warm
grant in a Slurm job; bench/fiberd_pss.py measures it and
tests/cli/test_bench_fiberd_pss.py holds fiberd to it. Within the budget fiberd is
ordinary Python, except for ``KEPT_OUT``: the modules a running fiberd does not import
until something asks for what they do, each with where that is done and why. The same
test checks that a standalone fiberd with a warm grant has loaded none of them.
Nothing else in the package bends for fiberd's memory.
"""

from __future__ import annotations

PSS_BUDGET_MB = 40.0

_TYPER = ("fiberd's and fiberd-run's command lines are parsed by "
          "cli/fiberd_options.plain_flags; typer (with click and pydantic: "
          "docs/benchmarks.md) is built only for --help or a line plain_flags leaves to it")

KEPT_OUT: dict[str, str] = {
    "typer": _TYPER,
    "click": _TYPER,
    "pydantic": _TYPER,
    "prometheus_client": ("imported the first time the metrics are read "
                          "(core/metrics/families.py): a fiberd nobody scrapes never loads it"),
    "psutil": ("fiberd-run records its own start time from /proc "
               "(homes/slurm/fiberdrecord.start_time), and the lease code imports it only to "
               "inspect a holder's process (lease/stale.py): only the hooks need it"),
}


def kept_out_loaded(modules: set[str] | dict[str, object]) -> list[str]:
    """The ``KEPT_OUT`` modules among ``modules`` (a process's ``sys.modules``), sorted."""
    return sorted(name for name in KEPT_OUT if name in modules)
