"""An example home, registered through the ``slurm_fiber.homes`` entry point.

``HOME`` is its registry entry: its name, the fiberd options it reads, how
it is built and its grant-conform stage. It stays light to import (the home
itself is imported inside ``build``), since every ``fiberd --help`` loads it.
"""

from __future__ import annotations

from collections.abc import Mapping

from slurm_fiber.config import FiberdConfig
from slurm_fiber.core.clock import Clock
from slurm_fiber.homes.problem import ProblemSink
from slurm_fiber.homes.select import BuiltHome, HomeEntry


async def build(config: FiberdConfig, clock: Clock, environ: Mapping[str, str],
                on_problem: ProblemSink) -> BuiltHome:
    """The example home of ``config``: its grantdir, its readiness log in the state dir."""
    from slurm_fiber_example_home.home import ExampleHome

    home = ExampleHome.from_config(config, clock, on_problem)
    return BuiltHome(home, config.audience or "example:local")


HOME = HomeEntry(
    "example", "an example: grants from a directory, readiness appended to a log", build,
    options=("grantdir", "poll_interval", "stale_ttl", "state_dir"),
    stage="slurm_fiber_example_home.stage:ExampleStage")
