"""fiberd-run on its event loop: serve, wait for a warm template, run one command as a fiber.

``run(config, argv, warm_timeout)`` is the whole life of a ``fiberd-run``
(cli/fiberd_run.py, which configures it first). Without
``argv`` it serves until SIGTERM/SIGINT; with it, it waits until a template
is warm, runs ``argv`` as a fiber with this process's stdio (Ctrl-C forwarded
to it), then stops fiberd. It returns the exit status the command line
promises (fiberd_run's module doc).
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import cast

from slurm_fiber.cli.fiberd import say
from slurm_fiber.config import FiberdConfig
from slurm_fiber.core.api.service import Clone, ExecTarget, Peer, Stdio
from slurm_fiber.core.book.misses import Miss
from slurm_fiber.daemon import Fiberd, serve, started, stop_on_signals


async def wait_warm(fiberd: Fiberd, timeout: float, stop: asyncio.Event) -> bool:
    """Block until a template is warm (True), ``timeout`` passes or ``stop`` is set (False).

    Prints progress to stderr once a second while it waits.
    """
    core = fiberd.running.core
    ticks_per_second = 20
    for tick in range(int(timeout * ticks_per_second) + 1):
        if core.ready():
            return True
        if stop.is_set():
            return False
        if tick and tick % ticks_per_second == 0:
            templates = cast("dict[str, str]", core.status()["templates"])
            states = ", ".join(f"{u}: {s}" for u, s in templates.items())
            fenced = ("; fenced: the control plane has not answered yet"
                      if core.health()["state"] == "never" else "")
            say(f"fiberd-run: warming ({states or 'no grant yet'}{fenced}) "
                f"{tick // ticks_per_second} s")
        await asyncio.sleep(1 / ticks_per_second)
    return core.ready()


async def run_command(fiberd: Fiberd, argv: list[str]) -> int:
    """Run ``argv`` as a fiber with this process's stdio; its shell status. SIGINT goes to it."""
    core = fiberd.running.core
    request = Clone(exec=ExecTarget(tuple(argv), os.getcwd()))
    outcome = await core.clone(request, Peer(os.getpid(), os.getuid(), os.getgid()),
                               Stdio(0, 1, 2))
    if isinstance(outcome, Miss):
        say(f"fiberd-run: clone missed: {outcome.code}: {outcome.reason}")
        return 1
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, outcome.fiber.signal, signal.SIGINT)
    try:
        return (await outcome.wait()).status
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def run(config: FiberdConfig, argv: list[str], warm_timeout: float) -> int:
    """Serve with ``config``; with ``argv``, run it once warm. Its status (module doc).
    Raises what ``started`` raises when fiberd cannot start."""
    stop = asyncio.Event()
    stop_on_signals(stop)  # before start-up: a SIGTERM meanwhile stops it once started
    async with started(config, os.environ) as fiberd:
        if not argv:
            why = await serve(fiberd.running, stop)
            return 0 if why == "stop requested" else 1
        serving = asyncio.ensure_future(serve(fiberd.running, stop))
        status = 1
        if await wait_warm(fiberd, warm_timeout, stop):
            status = await run_command(fiberd, argv)
        else:
            say(f"fiberd-run: no grant template warmed within {warm_timeout:g} s "
                f"(grantdir {config.grantdir})")
        stop.set()
        await serving
        return status
