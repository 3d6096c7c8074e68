"""The client side of fiberd's socket: everything a job or a user runs to ask a fiberd.

``discovery`` finds the socket, ``connection.FiberdClient`` speaks the protocol over
it (the shared vocabulary is ``slurm_fiber.protocol``), ``tasks.TaskRunner`` runs
many tasks over several connections, ``executor.Executor`` is the
``concurrent.futures`` face of it, ``fiberctl`` and ``fibermap`` (``fiberctl map``,
with ``mapinput``, ``mapspool``, ``mapnodes``) are the command line, and ``nodes``
spreads tasks over a Slurm job's nodes. Nothing here runs as root or decides
anything for fiberd: fiberd checks every request it gets.

This package is one of the two places of slurm_fiber where speed tricks live (the
other is fiberd's memory, bench/fiberd_pss.py). A job may start ``fiberctl run``
once per task, so what it imports is its start-up cost: the modules it loads avoid
``typing`` (``TYPE_CHECKING = False``), ``dataclasses``, ``re``, ``enum``, ``json``
(``protocol.framing`` calls the C codec) and import the rest where it is first
needed, and the protocol modules they load (``limits``, ``framing``, ``requests``,
``replies``) follow the same rule. tests/client/test_import_budget.py lists
exactly what ``fiberctl run`` may load.
"""
