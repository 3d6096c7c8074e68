"""``slurm-fiber node-metrics``: the node's relay of every job's fiberd metrics.

Runs as root on each Slurm node (contrib/systemd/slurm-fiber-node-metrics.service),
once or every ``--every`` seconds; each pass is ``homes.slurm.nodemetrics.relay_node``
for each node under the state root (or the ``--node`` names). A pass that fails for
one node is said in one line and the next pass tries again; the command itself fails
(exit 1) only when asked for one pass (``--every 0``) and that pass failed.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

HELP = (
    "Relay every job's fiberd metrics on this node to node_exporter: on a Slurm node, "
    "through node_exporter's textfile collector, one file per job, written atomically by "
    "root into "
    "STATE_ROOT/nodes/NODE/metrics/ (point node_exporter at "
    "--collector.textfile.directory=STATE_ROOT/nodes/*/metrics). Each job's fiberd is "
    "asked by a child running as the job's user; only slurm_fiber_* samples are kept, "
    "labelled with the job and node by the relay.\n\n"
    "Exit codes: 0 success; 1 a single pass (--every 0) failed (one line says why); "
    "2 usage error."
)


def node_metrics(
    state_root: Path | None = typer.Option(
        None, "--state-root", metavar="DIR",
        help="slurm_fiber's state root (default: $SLURM_FIBER_STATE_ROOT or "
        "/var/lib/slurm-fiber)"),
    node: list[str] = typer.Option([], "--node", metavar="NAME",
                                   help="relay this node only (repeatable; default: every "
                                   "node under the state root)"),
    every: float = typer.Option(15.0, "--every", metavar="SECONDS",
                                help="seconds between passes; 0: one pass, then exit"),
    timeout: float = typer.Option(2.0, "--timeout", metavar="SECONDS",
                                  help="seconds one job's fiberd has to answer"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="say what each pass did"),
) -> None:
    from slurm_fiber.homes.slurm.nodemetrics import nodes, relay_node
    from slurm_fiber.homes.slurm.paths import state_root as default_root

    root = state_root or default_root()
    while True:
        failed = False
        for name in node or nodes(root):
            try:
                done = relay_node(root, name, timeout)
            except (OSError, ValueError) as err:
                failed = True
                typer.echo(f"node-metrics: node {name}: {err}", err=True)
                continue
            if verbose:
                typer.echo(f"node {name}: up {list(done.up)}, down {list(done.down)}, "
                           f"removed {list(done.removed)}", err=True)
        if every <= 0:
            raise typer.Exit(1 if failed else 0)
        time.sleep(every)
