"""The socket API's view of a running fiber: a ``FiberHandle`` over a core ``Fiber``.

The API speaks in its own ``FiberExit`` (exit code, signal, rusage, a call's
result or error); the core's ``Fiber`` (its ``FiberEnd``) keeps the raw wait status and the
call-mode record. ``FiberView`` translates one into the other and nothing
else: waiting and records are the Fiber's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from slurm_fiber.core.api.service import FiberExit
from slurm_fiber.core.fibers.fiber import Fiber, FiberEnd, FiberState

LOST_ERROR = {"type": "FiberLost", "message": "the fiber died with its template"}
EXEC_FAILED_FIELDS = ("errno", "name", "path", "message", "interpreter")
SILENT_ERROR = {"type": "FiberDied", "message": "the fiber ended before reporting a result"}


def api_exit(fiber_id: str, mode: str, core: FiberEnd) -> FiberExit:
    """The API's exit record for a core exit. Pure; never raises."""
    rusage: dict[str, object] = {}
    if core.cpu_time is not None:
        rusage["cpu_time"] = core.cpu_time
    if core.maxrss is not None:
        rusage["maxrss_kib"] = core.maxrss // 1024
    if core.memory_peak is not None:
        rusage["memory_peak"] = core.memory_peak
    if core.oom_kills is not None:
        rusage["oom_kills"] = core.oom_kills  # > 0: the kernel OOM-killed in its cgroup
    result: object = None
    error: dict[str, object] | None = None
    exec_failed: dict[str, object] | None = None
    if core.state is FiberState.LOST:
        error = dict(LOST_ERROR)
    elif mode == "call":
        result, error = call_outcome(core.result)
    elif core.result is not None:  # exec mode: its exec, or the set-up before, failed
        failed, found = core.result.get("exec_failed"), core.result.get("error")
        if isinstance(failed, dict):
            exec_failed = {k: v for k, v in failed.items() if k in EXEC_FAILED_FIELDS}
        elif isinstance(found, dict):
            error = dict(found)
    return FiberExit(fiber_id=fiber_id, exit_code=core.exit_code, signal=core.signal,
                     rusage=rusage, result=result, error=error,
                     reason=core.reason.to_json() if core.reason else None,
                     exec_failed=exec_failed)


def call_outcome(record: dict[str, object] | None) -> tuple[object, dict[str, object] | None]:
    """A call fiber's result and error (one of them meaningful) from its record (None: it
    wrote none, and ended before reporting). Pure; never raises."""
    if record is not None and record.get("ok") is True:
        return record.get("result"), None
    found = (record or {}).get("error")
    return None, dict(found) if isinstance(found, dict) else dict(SILENT_ERROR)


class FiberView:
    """A started fiber as ``Service.clone`` returns it. ``record`` adds runtime fields."""

    def __init__(self, fiber: Fiber, extra: dict[str, object] | None = None) -> None:
        self.fiber = fiber
        self.extra = extra or {}

    @property
    def id(self) -> str:
        return self.fiber.id

    @property
    def pid(self) -> int:
        return self.fiber.pid

    def to_json(self) -> dict[str, object]:
        return {**self.fiber.to_json(), **self.extra}

    async def call_result(self) -> dict[str, object] | None:
        """A call fiber's ``result`` event (fiber_id and its result or error) as soon as it
        has written its record, before its exit; None when it wrote none (it ended before
        reporting: its exit event says how) or is no call. Never raises."""
        if self.fiber.mode != "call":
            return None
        record = await self.fiber.written()
        if record is None:
            return None
        result, error = call_outcome(record)
        found: dict[str, object] = {"fiber_id": self.fiber.id}
        if error is None:
            found["result"] = result
        else:
            found["error"] = error
        return found

    async def wait(self) -> FiberExit:
        """Wait until the fiber and its cgroup are gone; never raises."""
        core = await self.fiber.wait()
        return api_exit(self.fiber.id, self.fiber.mode, core)

    def on_exit(self, callback: Callable[[FiberExit], None]) -> None:
        """Call ``callback(exit)`` once the fiber and its cgroup are gone, in the loop step
        after its ``Fiber.on_done`` callbacks. The runtime registers its own as it starts
        the fiber, and that one schedules the write of the exit record in that step; so
        for a callback registered once the Clone is answered, the record is in the log
        first (as ``wait()`` sees it, one step on through its shield). Never called when
        its end was cancelled (fiberd is shutting down)."""
        def ended(fiber: Fiber) -> None:
            if fiber.exit is not None:
                asyncio.get_running_loop().call_soon(
                    callback, api_exit(fiber.id, fiber.mode, fiber.exit))

        self.fiber.on_done(ended)
