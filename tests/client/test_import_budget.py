"""The client's import budget: what ``fiberctl run`` (started once per task by a job) and
``fiberctl map``'s start may load, exactly, and the heavy modules they must not.

The one place this is checked (slurm_fiber/client/__init__.py declares the budget): each
case runs the command in a fresh interpreter, failing to connect (exit 69), and compares
the ``slurm_fiber`` modules it loaded with the list below; a module added to a client's
start-up path fails here until it is listed (and worth its cost) or imported later.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CLIENT = {"slurm_fiber", "slurm_fiber.client", "slurm_fiber.client.connection",
          "slurm_fiber.client.discovery", "slurm_fiber.client.fiberctl",
          "slurm_fiber.client.siteroot",
          "slurm_fiber.client.waits", "slurm_fiber.defaults", "slurm_fiber.errors",
          "slurm_fiber.protocol",
          "slurm_fiber.protocol.framing", "slurm_fiber.protocol.limits",
          "slurm_fiber.protocol.replies", "slurm_fiber.protocol.requests"}
# In a Slurm job the socket is the job's: the client reads the site file's state_root
# itself (client.siteroot) and places the socket by defaults' path convention, so a run
# in a job loads what any run does and no slurm_fiber.homes module.
IN_JOB: set[str] = set()
MAP = {"slurm_fiber.client.fibermap", "slurm_fiber.client.mapinput",
       "slurm_fiber.client.mapspool", "slurm_fiber.client.tasks", "slurm_fiber.safefs"}
# Never on a client's start: each costs about 0.5-10 ms of every task, or is the server's.
HEAVY = {"asyncio", "cryptography", "jwt", "prometheus_client", "ssl", "dataclasses",
         "inspect", "typing", "pathlib", "json", "shutil", "subprocess", "tempfile",
         "tomllib", "importlib.metadata", "slurm_fiber.core", "slurm_fiber.protocol.validate",
         "slurm_fiber.protocol.names", "slurm_fiber.core.api.service"}
# A task's run or call also spares what a map's option parsing and threads need.
RUN_HEAVY = HEAVY | {"argparse", "contextlib", "signal", "socket", "collections", "functools",
                     "re", "enum", "itertools", "operator", "warnings", "array"}

RUN = ("import sys\nfrom slurm_fiber.client.fiberctl import main\n"
       "try:\n    main(['run', *sys.argv[1:], '--', 'true'])\nexcept SystemExit as e:\n"
       "    assert e.code == 69, e.code\n"
       "print(' '.join(sorted(sys.modules)))")
MAP_START = ("import sys\nfrom slurm_fiber.client.fibermap import parse\n"
             "parse(['--range', '1-2', '--', 'true'])\nprint(' '.join(sorted(sys.modules)))")


def loaded(code: str, *argv: str, env: dict[str, str] | None = None) -> set[str]:
    return set(subprocess.run([sys.executable, "-c", code, *argv], capture_output=True,
                              text=True, check=True, env=env).stdout.split())


def job_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "slurm-fiber.toml"
    site.write_text(f'state_root = "{tmp_path}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "FIBERD"))}
    return env | {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1",
                  "SLURM_FIBER_CONFIG": str(site)}


@pytest.mark.parametrize("case", ["run --socket", "run in a job", "map's start"])
def test_a_clients_start_loads_exactly_its_budget(case: str, tmp_path: Path) -> None:
    if case == "run --socket":
        modules, allowed, heavy = loaded(RUN, "-S", "/nonexistent"), CLIENT, RUN_HEAVY
    elif case == "run in a job":  # waits for the job's socket, then 69
        modules = loaded(RUN, "--wait", "0.3", env=job_env(tmp_path))
        allowed, heavy = CLIENT | IN_JOB, RUN_HEAVY
    else:
        modules, allowed, heavy = loaded(MAP_START), CLIENT | MAP, HEAVY
    ours = {m for m in modules if m.split(".")[0] == "slurm_fiber"}
    assert ours == allowed, (f"loaded but not in the budget: {sorted(ours - allowed)}; "
                             f"in the budget, not loaded: {sorted(allowed - ours)}")
    assert not heavy & modules, f"heavy modules on a client's start: {sorted(heavy & modules)}"
