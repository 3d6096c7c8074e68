"""Helpers for process-layer tests: run async tests, start templates, walk /proc and cgroups.

``cgroup2_usable()`` says whether the real cgroup2 hierarchy at ``UNIFIED`` is writable
(``cgroup_root`` in tests/core/conftest.py skips without it).

``marked_procs(mark)`` walks /proc for live (non-zombie) processes whose
environment carries ``SF_TEST_MARK=<mark>``: templates and fibers inherit
it, so a leak check never confuses another test's processes with ours.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from slurm_fiber.core.cgroups.common import GrantCgroup
from slurm_fiber.core.cgroups.v1 import V1Layout
from slurm_fiber.core.clock import Clock, SystemClock
from slurm_fiber.core.devices import DeviceChannel
from slurm_fiber.core.fibers.fiber import Fiber
from slurm_fiber.core.templates.parent import (
    ExecSpawn,
    FiberRequest,
    Template,
    TemplateState,
    template_env,
)
from slurm_fiber.core.trust.grant import TemplateSpec
from slurm_fiber.procs import marked

REPO = Path(__file__).resolve().parents[2]
UNIFIED = Path("/sys/fs/cgroup/unified")


def cgroup2_usable() -> bool:
    probe = UNIFIED / f"sf-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return False
    return (UNIFIED / "cgroup.controllers").is_file()


def v1_usable(controller: str) -> bool:
    """Whether this process may make groups in the cgroup v1 ``controller`` hierarchy (a
    container may show the host's mounted read-only: mounted is not enough)."""
    mount = V1Layout.of_self().mounts.get(controller)
    return mount is not None and os.access(mount, os.W_OK)


def aio(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body on a fresh event loop."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return run


async def start_template(tmp: Path, mark: str, *, preload: tuple[str, ...] = (),
                         warm: str | None = None, cgroup: GrantCgroup | None = None,
                         channel: DeviceChannel | None = None, clock: Clock | None = None,
                         uid: str = "grant-1", spares: int = 1,
                         timeout: float = 10.0, exec_spawn: ExecSpawn = "hot",
                         spares_idle: float | None = None) -> Template:
    """A template whose env carries the test's mark and can import ``tests``
    (``exec_template`` tests exec fibers started both ways)."""
    spec = TemplateSpec(preload=preload, warm=warm,
                        env={"SF_TEST_MARK": mark, "PYTHONPATH": str(REPO)})
    env = template_env(dict(os.environ), spec, channel or DeviceChannel())
    state = tmp / "state"
    state.mkdir(exist_ok=True)
    return await Template.start(uid, spec, env, cgroup, state_dir=state,
                                clock=clock or SystemClock(), spares=spares, timeout=timeout,
                                exec_spawn=exec_spawn, spares_idle=spares_idle)


async def read_line(fd: int) -> bytes:
    """One line from a pipe, read off the event loop (b"" at EOF)."""
    loop = asyncio.get_running_loop()
    data = b""
    while not data.endswith(b"\n"):
        chunk = await loop.run_in_executor(None, os.read, fd, 100)
        if not chunk:
            break
        data += chunk
    return data


async def warm_template(tmp: Path, mark: str, **kwargs: Any) -> Template:
    """``start_template`` and wait until it is ready (asserted)."""
    t = await start_template(tmp, mark, **kwargs)
    assert await t.wait_warm() is TemplateState.READY, t.warm_error
    return t


EXEC_STARTS = ("forked", "spawned")  # how an exec fiber may start (core/templates.py)


async def exec_template(tmp: Path, mark: str, start: str, **kwargs: Any) -> Template:
    """A ready template whose exec fibers start as ``start`` says: from a forked spare, or
    spawned straight into their leaf (core/exec_spawn.py)."""
    return await warm_template(tmp, mark, exec_spawn="always" if start == "spawned" else "never",
                               **kwargs)


async def fork_as(t: Template, start: str, request: FiberRequest) -> Fiber:
    """Fork ``request``; for "spawned", check the fiber took no idle spare; for "forked",
    that it did when one was idle."""
    spares = set(t.idle_spares)
    fiber = await t.fork(request)
    assert (fiber.pid in spares) == (start == "forked" and bool(spares))
    return fiber


async def stop_on_fake_clock(template: Template, clock: Any, grace: float = 1) -> None:
    """Stop ``template`` while advancing the fake ``clock`` a second at a time (its
    graces and bounds run on it), until the stop has returned."""
    stopping = asyncio.ensure_future(template.stop(grace))
    while not stopping.done():
        await clock.advance_and_settle(1)
        await asyncio.sleep(0.01)
    await stopping


def marked_procs(mark: str) -> list[int]:
    """Pids of live, non-zombie processes whose environ has SF_TEST_MARK=mark."""
    return marked(mark, "SF_TEST_MARK")


def wait_marked(mark: str, count: int, within: float = 10.0) -> list[int]:
    """Marked processes, polled until there are ``count`` of them or ``within`` s passed."""
    end = time.monotonic() + within
    while len(found := marked_procs(mark)) != count and time.monotonic() < end:
        time.sleep(0.02)
    return found


async def idle_spares(template: Template, count: int = 1, within: float = 10.0) -> list[int]:
    """The template's idle spares, polled until there are ``count`` or ``within`` s passed."""
    end = time.monotonic() + within
    while len(template.idle_spares) != count and time.monotonic() < end:
        await asyncio.sleep(0.01)
    return template.idle_spares


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc ("R", "S", "T", "Z" ...; "" once reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # reaped before, or while, it is read
        return ""


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    return proc_state(pid) not in ("Z", "")


def wait_dead(pid: int, within: float = 10.0) -> bool:
    """Whether ``pid`` ended (a zombie or reaped) within ``within`` s; blocks, polling /proc
    (so the event loop hears of it only afterwards)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if proc_state(pid) in ("Z", ""):
            return True
        time.sleep(0.005)
    return False


def wait_state(pid: int, state: str, within: float = 10.0) -> bool:
    """Whether ``pid`` reached the /proc state ``state`` within ``within`` s (blocks)."""
    end = time.monotonic() + within
    while proc_state(pid) != state and time.monotonic() < end:
        time.sleep(0.005)
    return proc_state(pid) == state


def unified_cgroup(pid: int) -> str:
    """The cgroup v2 path of ``pid`` ("" when it has none)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return ""


def cgroup_dirs(root: Path) -> list[Path]:
    """Every cgroup directory below ``root`` (not root itself); one removed while it is
    listed (fiberd removes leaves in the background) is left out, not an error."""
    return sorted(Path(top, d) for top, dirs, _ in os.walk(root) for d in dirs)
