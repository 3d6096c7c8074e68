"""Test helpers for the socket API: a Service that really runs processes, served in a thread.

``ProcService`` is a small runtime stand-in: it execs argv (exec mode) or
runs ``module:function`` in a fresh interpreter (call mode) with the passed
stdio descriptors, tracks each child with a pidfd, reaps it with wait4 for
its rusage, and can signal and stop it. Grants named ``cold-*`` miss with
``cold`` (retryable) and ``gone-*`` with ``unknown_grant`` (final); a grant
named ``boom`` makes the service raise (``emfile``: raise EMFILE, as when fiberd is
out of descriptors). ``served`` runs an ApiServer for it
on a loop in a background thread, as fiberd would, so tests can use
blocking clients, threads and subprocesses against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_fiber.core.api.server import ApiServer, Refusal, ServerConfig
from slurm_fiber.core.api.service import (
    Clone,
    FiberExit,
    FiberNotFound,
    Forked,
    Peer,
    Stdio,
    page,
)
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.clock import Clock

CALL_RUNNER = """
import importlib, json, os, sys
fd, spec = int(sys.argv[1]), json.loads(sys.argv[2])
module, _, name = spec["target"].partition(":")
fn = importlib.import_module(module)
for part in name.split("."):
    fn = getattr(fn, part)
try:
    out = {"result": fn(*spec.get("args", []), **spec.get("kwargs", {}))}
except Exception as e:
    out = {"error": {"type": type(e).__name__, "message": str(e)}}
os.write(fd, json.dumps(out).encode())
"""


@dataclass
class ProcFiber:
    """One child process; ``wait`` may be awaited by many."""

    id: str
    pid: int
    grant: str | None
    proc: subprocess.Popen[bytes]
    exited: asyncio.Future[FiberExit]
    result_fd: int | None = None
    signals: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        done = self.exited.done()
        return {"id": self.id, "pid": self.pid, "grant": self.grant,
                "state": "exited" if done else "running",
                "exit_status": self.exited.result().status if done else None}

    async def call_result(self) -> dict[str, object] | None:
        return None  # this runtime's results come with the exit only

    async def wait(self) -> FiberExit:
        return await asyncio.shield(self.exited)

    def on_exit(self, callback: Callable[[FiberExit], None]) -> None:
        self.exited.add_done_callback(lambda done: callback(done.result()))


class ProcService:
    """The test runtime. Lives on the server's loop."""

    def __init__(self) -> None:
        self.fibers: dict[str, ProcFiber] = {}
        self.ids = itertools.count(1)
        self.stdio_seen: list[Stdio] = []

    async def clone(self, request: Clone, peer: Peer, stdio: Stdio) -> ProcFiber | Miss:
        grant = request.grant or ""
        if grant.startswith("cold-"):
            return Miss(MissCode.COLD, "template still warming", retry_after=0.5)
        if grant.startswith("gone-"):
            return Miss(MissCode.UNKNOWN_GRANT, f"no grant {grant} here")
        if grant.startswith("slow-"):  # answered after its client may have left
            await asyncio.sleep(0.5)
        if grant == "boom":
            raise RuntimeError("the runtime broke")
        if grant == "emfile":
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        self.stdio_seen.append(stdio)
        env = {**os.environ, **request.env}
        result_fd = None
        if request.exec is not None:
            argv, cwd, keep = list(request.exec.argv), request.exec.cwd, ()
        else:
            assert request.call is not None
            result_fd, write_fd = os.pipe()
            spec = {"target": request.call.target, "args": list(request.call.args),
                    "kwargs": dict(request.call.kwargs)}
            argv = [sys.executable, "-c", CALL_RUNNER, str(write_fd), json.dumps(spec)]
            cwd, keep = None, (write_fd,)
        try:
            proc = subprocess.Popen(argv, stdin=stdio.stdin, stdout=stdio.stdout,
                                    stderr=stdio.stderr, cwd=cwd, env=env, pass_fds=keep,
                                    start_new_session=True)
        finally:
            for fd in keep:
                os.close(fd)
        loop = asyncio.get_running_loop()
        fiber = ProcFiber(f"f{next(self.ids)}", proc.pid, request.grant, proc,
                          loop.create_future(), result_fd)
        self.fibers[fiber.id] = fiber
        pidfd = os.pidfd_open(proc.pid)
        loop.add_reader(pidfd, self._reap, fiber, pidfd)
        return fiber

    async def clone_batch(self, requests: list[Clone], peer: Peer, stdios: list[Stdio],
                          batch: int | None = None, forked: Forked | None = None,
                          ) -> list[ProcFiber | Miss | Exception]:
        """Each item as ``clone``; an item that raises fails alone; ``forked`` told of each
        fiber started."""
        out: list[ProcFiber | Miss | Exception] = []
        for request, stdio in zip(requests, stdios, strict=True):
            try:
                out.append(outcome := await self.clone(request, peer, stdio))
            except Exception as err:
                out.append(err)
                continue
            if forked is not None and isinstance(outcome, ProcFiber):
                forked(outcome)
        return out

    def _reap(self, fiber: ProcFiber, pidfd: int) -> None:
        asyncio.get_running_loop().remove_reader(pidfd)
        os.close(pidfd)
        _, status, usage = os.wait4(fiber.pid, 0)
        fiber.proc.returncode = status  # reaped here, not by Popen
        outcome: dict[str, Any] = {}
        if fiber.result_fd is not None:
            data = b""
            while chunk := os.read(fiber.result_fd, 65536):
                data += chunk
            os.close(fiber.result_fd)
            outcome = json.loads(data) if data else {
                "error": {"type": "died", "message": "the fiber died before answering"}}
        fiber.exited.set_result(FiberExit(
            fiber_id=fiber.id,
            exit_code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            rusage={"utime": usage.ru_utime, "stime": usage.ru_stime,
                    "maxrss_kib": usage.ru_maxrss},
            result=outcome.get("result"), error=outcome.get("error")))

    def _fiber(self, fiber_id: str) -> ProcFiber:
        if fiber_id not in self.fibers:
            raise FiberNotFound(fiber_id)
        return self.fibers[fiber_id]

    def list_fibers(self, after: str | None = None, limit: int | None = None,
                    ended: bool = False) -> tuple[list[dict[str, object]], str | None]:
        """The fibers running (this service remembers none that ended)."""
        ordered = ((int(fid[1:]), f) for fid, f in self.fibers.items())
        fibers, cursor = page(ordered, after, limit)
        return [f.to_json() for f in fibers], cursor

    def inspect_fiber(self, fiber_id: str) -> dict[str, object]:
        return self._fiber(fiber_id).to_json()

    async def stop_fiber(self, fiber_id: str, grace: float | None, peer: Peer) -> dict[str, object]:
        fiber = self._fiber(fiber_id)
        if not fiber.exited.done():
            os.kill(fiber.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(fiber.wait(), 2.0 if grace is None else grace)
            except TimeoutError:
                os.kill(fiber.pid, signal.SIGKILL)
                await fiber.wait()
        return fiber.to_json()

    def signal_fiber(self, fiber_id: str, signum: int, peer: Peer) -> bool:
        fiber = self._fiber(fiber_id)
        if fiber.exited.done():
            return False
        fiber.signals.append(signum)
        os.kill(fiber.pid, signum)
        return True

    def list_grants(self) -> list[dict[str, object]]:
        return [{"uid": "g1", "state": "warm"}]

    def status(self) -> dict[str, object]:
        return {"home": "test", "epoch": 1, "cgroups": "uncarved"}

    def health(self) -> dict[str, object]:
        return {"state": "fresh", "age": 0.0}

    def ready(self) -> bool:
        return True

    def fibers_running(self) -> int:
        return sum(1 for f in self.fibers.values() if not f.exited.done())

    def kill_all(self) -> None:
        for f in self.fibers.values():
            if not f.exited.done():
                os.kill(f.pid, signal.SIGKILL)


@dataclass
class Served:
    """A running server and handles to drive it from the test thread."""

    path: Path
    server: ApiServer
    service: ProcService
    loop: asyncio.AbstractEventLoop
    refusals: list[Refusal]

    def call(self, fn: Callable[[], Coroutine[Any, Any, Any]], timeout: float = 10.0) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """Run a plain function on the server's loop and return its result."""
        async def wrapped() -> Any:
            return fn()
        return self.call(wrapped)


@contextlib.contextmanager
def serve(path: Path, clock: Clock, **config: Any) -> Iterator[Served]:
    """Start a ProcService server on a fresh loop in a thread; stop it afterwards."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    service = ProcService()
    refusals: list[Refusal] = []
    server = ApiServer(service, ServerConfig(path=path, **config), clock=clock,
                       audit=refusals.append)
    served = Served(path, server, service, loop, refusals)
    served.call(server.start)
    served.on_loop(server.accept)
    try:
        yield served
    finally:
        served.on_loop(service.kill_all)
        served.call(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
