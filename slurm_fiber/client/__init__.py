"""The client side of fiberd's socket: everything a job or a user runs to ask a fiberd.

``discovery`` finds the socket, ``connection.FiberdClient`` speaks the protocol over
it (the shared vocabulary is ``slurm_fiber.protocol``), ``tasks.TaskRunner`` runs
many tasks over several connections, ``executor.Executor`` is the
``concurrent.futures`` face of it, ``fiberctl`` and ``fibermap`` (``fiberctl map``,
with ``mapinput``, ``mapspool``, ``mapnodes``) are the command line, and ``nodes``
spreads tasks over a Slurm job's nodes. Nothing here runs as root or decides
anything for fiberd: fiberd checks every request it gets.

The import budget: this package is one of the two places of slurm_fiber where speed
tricks live (the other is fiberd's memory, core/runtime/memory.py). A job may start
``fiberctl run`` once per task, so what ``run`` imports (in a job or given its socket)
and what ``fiberctl map`` imports to start is fixed: exactly the slurm_fiber modules
listed in tests/client/test_import_budget.py, the one test of it, and none of the
heavy standard modules it names (``typing``, ``dataclasses``, ``re``, ``enum``,
``json``, ``pathlib``, ``tomllib``, ...). So the modules on that path, and the
protocol modules they load (``limits``, ``framing``, ``requests``, ``replies``),
import typing only under ``TYPE_CHECKING = False`` and anything else where it is
first needed. The figures behind the budget are in docs/benchmarks.md.
"""
