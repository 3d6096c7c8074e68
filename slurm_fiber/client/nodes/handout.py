"""The nodes of a Slurm job, each with a ``TaskRunner``, and which of them are lost.

``JobNodes.start(...)`` makes one runner per node of the job (``SLURM_JOB_NODELIST``,
expanded by ``scontrol show hostnames``): the node this runs on through its fiberd's
socket as fiberctl finds it, every other through a relay over srun (nodes/link.py),
started at once (their steps start in parallel). ``lose(node, why)`` marks a node lost
for the rest of the run and says so once on stderr; callers hand its unfinished work
to the nodes still alive (``HandOut`` does that for the Executor). ``stop_all``,
``cancel_pending`` and ``close`` act on every runner (``close`` also ends every relay,
bounded by the link's CLOSE_WAIT each).
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from slurm_fiber.client.discovery import discover_socket
from slurm_fiber.client.nodes.link import Link
from slurm_fiber.client.tasks import TaskRunner

SCONTROL_WAIT = 30.0
T = TypeVar("T")


@dataclass
class Node:
    """One node of the job: its name, runner, link (None: this node) and, once lost,
    why."""

    name: str
    runner: TaskRunner
    link: Link | None = None
    lost: str | None = None


def job_node_names(env: Mapping[str, str] | None = None) -> list[str]:
    """The job's nodes, in Slurm's order (empty outside a job). Raises OSError or
    subprocess.SubprocessError when scontrol fails."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not env.get("SLURM_JOB_ID") or not nodelist:
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True, check=True, timeout=SCONTROL_WAIT)
    return out.stdout.split()


class JobNodes:
    """Every node's runner (see the module doc)."""

    def __init__(self, nodes: list[Node], say: Callable[[str], None]) -> None:
        self.nodes, self.say = nodes, say
        self.lock = threading.Lock()

    @classmethod
    def start(cls, names: list[str], socket: str | None, tell: Callable[[str], None],
              server_uids: Collection[int] | None = None,
              **runner: Any) -> JobNodes:
        """Runners for ``names``: this node's (``SLURMD_NODENAME``) on its socket, the
        others through relays; ``runner``: TaskRunner's keyword arguments."""
        here = os.environ.get("SLURMD_NODENAME")
        nodes = []
        for name in names:
            if name == here:
                nodes.append(Node(name, TaskRunner(discover_socket(socket),
                                                   server_uids=server_uids, **runner)))
                continue
            link = Link(name, socket, sorted(server_uids) if server_uids else None)
            nodes.append(Node(name, TaskRunner(f"{name}:fiberd (through srun)",
                                               opener=link.open, **runner), link))
        return cls(nodes, tell)

    def alive(self) -> list[Node]:
        with self.lock:
            return [n for n in self.nodes if n.lost is None]

    def lose(self, node: Node, why: str) -> bool:
        """Mark ``node`` lost (said once on stderr); False if it was already."""
        with self.lock:
            if node.lost is not None:
                return False
            node.lost = why
        self.say(f"node {node.name} lost ({why}); its unfinished tasks run on the other "
                 "nodes")
        return True

    def stop_all(self) -> int:
        return sum(n.runner.stop_all() for n in self.nodes if n.lost is None)

    def cancel_pending(self) -> None:
        for n in self.nodes:
            n.runner.cancel_pending()

    def close(self) -> None:
        for n in self.nodes:
            n.runner.close()
            if n.link is not None:
                n.link.close()


class HandOut(Generic[T]):
    """Items handed to every node's ``slots`` worker threads as each has room.

    ``run(node, item)`` runs one item on ``node`` (on the worker's thread) and returns
    False when the node was lost doing it (``JobNodes.lose``): the item goes back to the
    front, for a worker of another node; with no node left, ``fail(item, why)`` ends it.
    ``shutdown`` lets the workers finish what is queued (and what a lost node gives
    back), then end; ``drain`` takes what no worker has taken yet.
    """

    def __init__(self, nodes: JobNodes, slots: int, run: Callable[[Node, T], bool],
                 fail: Callable[[T, str], None]) -> None:
        self.nodes, self.run, self.fail = nodes, run, fail
        self.cv = threading.Condition()
        self.items: deque[T] = deque()
        self.out = 0  # taken, not yet done or given back
        self.closing = False
        self.threads = [threading.Thread(target=self.worker, args=(node,), daemon=True,
                                         name=f"slurm-fiber-{node.name}-{slot}")
                        for node in nodes.nodes for slot in range(slots)]
        for thread in self.threads:
            thread.start()

    def put(self, item: T) -> None:
        with self.cv:
            self.items.append(item)
            self.cv.notify()

    def drain(self) -> list[T]:
        with self.cv:
            items, self.items = list(self.items), deque()
        return items

    def shutdown(self, wait: bool) -> None:
        with self.cv:
            self.closing = True
            self.cv.notify_all()
        if wait:
            for thread in self.threads:
                thread.join()

    def take(self, node: Node) -> T | None:
        with self.cv:
            while True:
                if node.lost is not None:
                    return None
                if self.items:
                    self.out += 1
                    return self.items.popleft()
                if self.closing and self.out == 0:
                    self.cv.notify_all()
                    return None
                self.cv.wait()

    def worker(self, node: Node) -> None:
        while (item := self.take(node)) is not None:
            done = False
            try:
                done = self.run(node, item)
            finally:
                alive = bool(self.nodes.alive())
                with self.cv:
                    self.out -= 1
                    if not done and alive:
                        self.items.appendleft(item)
                    self.cv.notify_all()
                if not done and not alive:
                    self.fail(item, f"every node of the job is lost (the last: {node.name}: "
                              f"{node.lost})")
                    for left in self.drain():
                        self.fail(left, "every node of the job is lost")
