"""``fiberctl map --nodes all --via relay``: tasks handed out to every node as each has room.

The map runs where it was started (the job's first node, in a batch script) and reaches
every node's fiberd: its own through its socket, each other one through a relay that
``srun --overlap`` runs on that node, whose stdin and stdout carry the socket protocol
(slurm_fiber/client/nodes/: nothing listens on the network, no credential is added). Each
node keeps ``-j`` slots, one worker thread each; a worker takes the next task when its
slot is free, so a node slowed by long tasks takes fewer and the others take the rest
(``--split rr`` keeps the round-robin split, sequence number modulo the node count,
on the same transport: bench/nodes.py compares the two). Output, ``--results``
and the joblog are written here, as a one-node map writes them (Host: the node that
ran the task; the summary's ``nodes``: how many tasks each ran).

A node lost mid-map (its relay ended: srun, the node or its fiberd gone; or its fiberd's
connection broke) is named once on stderr and takes no more tasks; each of its tasks
that had not ended is run again on the nodes still alive (from the start: a fiber dies
with its fiberd). With no node left the map stops as fiberctl map does when fiberd is
unreachable (exit 69). ``--halt`` acts on every node; ``{%}`` is the slot on its node.
Not covered: a node that hangs without its stream ending holds its running tasks.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator

from slurm_fiber.client.fiberctl import EXIT_UNREACHABLE
from slurm_fiber.client.fibermap import EXIT_OTHER, Map
from slurm_fiber.client.mapinput import Args, command_words
from slurm_fiber.client.nodes.handout import JobNodes, Node, job_node_names
from slurm_fiber.client.tasks import Outcome, in_job
from slurm_fiber.protocol.framing import json_dumps

Item = tuple[int, Args, list[str], int]  # seq, args, words, try number


class NodesMap(Map):
    """A Map whose slots are every node's (see the module doc)."""

    def __init__(self, opts: argparse.Namespace, nodes: JobNodes,
                 args: Iterator[tuple[int, Args]], total: int | None, robin: bool) -> None:
        super().__init__(opts, nodes, args, total)  # type: ignore[arg-type]
        self.nodes = nodes
        self.placed: dict[int, str] = {}  # seq → the node that ran its last try
        self.ran: dict[str, int] = {n.name: 0 for n in nodes.nodes}
        self.handout = threading.Condition()
        self.again: deque[Item] = deque()  # tasks a lost node did not end
        self.out = 0  # tasks taken and not yet ended or handed back
        self.drained = False  # ``args`` has no more
        self.robin: dict[str, deque[tuple[int, Args]]] | None = None
        if robin:
            count = len(nodes.nodes)
            self.robin = {n.name: deque() for n in nodes.nodes}
            for seq, arg in args:
                self.robin[nodes.nodes[(seq - 1) % count].name].append((seq, arg))

    def workers(self) -> list[threading.Thread]:
        return [threading.Thread(target=self.node_worker, args=(node, slot), daemon=True,
                                 name=f"map-{node.name}-{slot}")
                for node in self.nodes.nodes for slot in range(1, self.opts.jobs + 1)]

    # ------------------------------------------------------------ hand-out

    def take(self, node: Node) -> Item | None:
        """The next task for a free slot of ``node``: one a lost node gave back, else the
        next argument (robin: the next of the node's own); None once none is left or the
        map stops. Waits while tasks run elsewhere (a lost node may give them back)."""
        with self.handout:
            while True:
                if self.stopping or node.lost is not None:
                    return None
                if self.again:
                    self.out += 1
                    return self.again.popleft()
                nxt = self.next_own(node)
                if nxt is not None:
                    self.out += 1
                    return nxt
                if self.out == 0:
                    self.handout.notify_all()
                    return None
                self.handout.wait(0.5)

    def next_own(self, node: Node) -> Item | None:
        if self.robin is not None:
            mine = self.robin[node.name]
            if not mine:
                return None
            seq, arg = mine.popleft()
        else:
            if self.drained:
                return None
            item = self.next_arg()
            if item is None:
                self.drained = True
                return None
            seq, arg = item
        return (seq, arg, [], 1)

    def settle(self, item: Item | None) -> None:
        """A taken task ended (None) or is handed back (``item``)."""
        with self.handout:
            self.out -= 1
            if item is not None:
                self.again.append(item)
            self.handout.notify_all()

    def lost(self, node: Node, why: str, item: Item) -> None:
        """``node`` is lost: hand ``item`` back (and stop the map if no node is left)."""
        self.nodes.lose(node, why)
        if self.robin is not None:
            with self.handout:  # its own tasks not yet taken go to the others
                for seq, arg in self.robin.pop(node.name, deque()):
                    self.again.append((seq, arg, [], 1))
                self.robin[node.name] = deque()
        if not self.nodes.alive():
            with self.lock:
                if self.abort is None:
                    self.abort = (EXIT_UNREACHABLE, f"fiberctl map: every node is lost "
                                  f"(the last: {node.name}: {why})")
                self.stopping = True
        self.settle(None if self.stopping else item)

    # ------------------------------------------------------------ running

    def node_worker(self, node: Node, slot: int) -> None:
        """One slot of ``node``: take a task, run it there, finish it; again."""
        while (item := self.take(node)) is not None:
            seq, arg, _words, attempt = item
            words = command_words(self.opts.cmd, arg, seq, slot, self.opts.call is not None)
            out, err = os.memfd_create("fiber-stdout"), os.memfd_create("fiber-stderr")
            try:
                outcome = node.runner.run(self.task(words, out, err))
                if outcome.failure is not None and not outcome.refused:
                    self.lost(node, outcome.failure, item)
                    return
                self.task_ended(node, (seq, arg, words, attempt), outcome, out, err)
            finally:
                os.close(out)
                os.close(err)

    def task_ended(self, node: Node, item: Item, outcome: Outcome, out: int, err: int) -> None:
        seq, arg, words, attempt = item
        if outcome.cancelled:
            self.settle(None)
            return
        stdout, stderr = self.output(outcome, out, err)
        if not (outcome.ok or self.abort_for(outcome) or attempt >= self.opts.retries):
            with self.lock:
                retry = not self.stopping
            if retry:
                self.settle((seq, arg, [], attempt + 1))
                return
        with self.lock:
            self.placed[seq] = node.name
            if outcome.exit is not None:
                self.ran[node.name] += 1
                node.runner.wait_listening = False  # reached: a fiberd gone now is lost
        self.finish(seq, arg, words, outcome, stdout, stderr)
        self.settle(None)

    def emit(self, seq: int, arg: Args, words: list[str], outcome: Outcome,
             stdout: bytes, stderr: bytes) -> None:
        self.host = self.placed.get(seq, ":")  # (lock held: finish's)
        super().emit(seq, arg, words, outcome, stdout, stderr)

    def summary(self, status: int) -> dict[str, object]:
        return {**super().summary(status), "nodes": dict(self.ran),
                "lost": {n.name: n.lost for n in self.nodes.nodes if n.lost is not None}}


def run_across_nodes(opts: argparse.Namespace, fields: dict[str, object],
                     tasks: Iterator[tuple[int, Args]], total: int | None,
                     say: Callable[[str], None]) -> int | None:
    """Run the map over every node of this job; its exit status, or None when this is no
    job of several nodes (the caller runs it here)."""
    try:
        names = job_node_names()
    except (OSError, ValueError) as err:
        print(f"fiberctl map: --nodes all: cannot list the job's nodes: {err}",
              file=sys.stderr)
        return EXIT_OTHER
    except Exception as err:  # subprocess's errors: scontrol failed
        print(f"fiberctl map: --nodes all: scontrol show hostnames failed: {err}",
              file=sys.stderr)
        return EXIT_OTHER
    if len(names) < 2:
        return None
    nodes = JobNodes.start(names, opts.socket, say, grant=fields.get("grant"),
                           token=fields.get("token"), env=fields.get("env"),
                           wait=None if opts.no_wait else opts.wait,
                           wait_listening=in_job() or opts.wait_given, say=say)
    job = NodesMap(opts, nodes, tasks, total, opts.split == "rr")
    try:
        try:
            status = job.run()
        except KeyboardInterrupt:
            print("fiberctl map: interrupted; running fibers were stopped", file=sys.stderr)
            return 130
    finally:
        nodes.close()
    if opts.json:
        print(json_dumps(job.summary(status)))
    return status

