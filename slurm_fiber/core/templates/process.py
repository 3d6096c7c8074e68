"""The template process: started, served, guarded against stalls, killed and re-warmed.

``TemplateProcess.spawn`` starts ``template_main`` with exactly the template's
environment (``PYTHONPATH`` entries another user could write left out), as the
grant's account when fiberd runs as root (moved into its leaf first: ``_place``), its
output in ``template-<uid>.log``, tied to fiberd by PR_SET_PDEATHSIG (start it from the
loop's thread: the death signal follows the thread that forked). ``_watch`` serves its
messages until it dies (its pidfd says so: a descendant holding the socket cannot keep
fiberd waiting), then has what it left killed and re-warms it after the lifecycle's
backoff. ``_guard`` gives it up once templates/stall.py judges it stalled (a spare
request unanswered, or the process stopped, for ``timeout`` seconds while fiberd was
watching). ``kill`` ends the process, its process group and, carved, its leaf; never
raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Mapping
from typing import TYPE_CHECKING

from slurm_fiber.core.cgroups.common import join as cgroup_join
from slurm_fiber.core.cgroups.common import populated, safe_name
from slurm_fiber.core.cgroups.groups import kill as cgroup_kill
from slurm_fiber.core.cgroups.v1 import mirrors as cgroup_mirrors
from slurm_fiber.core.templates import stall, wire
from slurm_fiber.core.templates.dirtrust import safe_path_entry
from slurm_fiber.core.templates.lifecycle import Event, Phase
from slurm_fiber.core.waiting import first_done, pidfd_wait, stopped

if TYPE_CHECKING:
    from slurm_fiber.core.templates.parent import Template

log = logging.getLogger("slurm_fiber.core.templates.parent")


def template_command(python: str, env: Mapping[str, str], fd: int,
                     parent: int, no_new_privs: bool = False
                     ) -> tuple[list[str], dict[str, str], list[str]]:
    """The argv and env that start a template (``template_main``), and the PYTHONPATH entries
    left out as unsafe (one line each, for fiberd's log). ``no_new_privs``: the template
    sets it first thing (a root fiberd's, core/identity.py)."""
    env = dict(env)
    dropped = []
    if env.get("PYTHONPATH"):
        kept = []
        for entry in env["PYTHONPATH"].split(os.pathsep):
            why = safe_path_entry(entry)
            if why is None:
                kept.append(entry)
            else:
                dropped.append(f"PYTHONPATH entry {entry!r} left out: {why}")
        env["PYTHONPATH"] = os.pathsep.join(kept)
    argv = [python, "-P", "-m", "slurm_fiber.core.templates.child.main", "--fd", str(fd),
            "--parent", str(parent), *(["--no-new-privs"] if no_new_privs else [])]
    return argv, env, dropped


class TemplateProcess:
    """One template's process over its lifetimes (see the module doc)."""

    def __init__(self, template: Template) -> None:
        self.t = template
        self.pid: int | None = None
        self.sock: socket.socket | None = None
        self.pidfd: int | None = None
        self.task: asyncio.Task[None] | None = None

    def spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log_path = self.t.state_dir / f"template-{safe_name(self.t.uid)}.log"
        identity = self.t.identity
        argv, env, dropped = template_command(self.t.python, self.t.env, theirs.fileno(),
                                              os.getpid(), no_new_privs=identity is not None)
        for line in dropped:
            log.warning("template of %s: %s", self.t.uid, line)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with theirs, open(os.open(log_path, flags, 0o600), "ab") as log_file:
            # Another account starts in "/": fiberd's state dir is not its to read.
            proc = subprocess.Popen(
                argv, env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                stdout=log_file, stderr=log_file,
                cwd="/" if self.t.orders.other_account else self.t.state_dir,
                **(identity.spawn_args() if identity is not None else {}))
        if self.t.orders.other_account and self.t.cgroup is not None:
            self._place(proc)
        ours.setblocking(False)
        self.sock = ours
        self.pidfd = os.pidfd_open(proc.pid)
        self.pid = proc.pid
        order = {"t": "warm", "preload": list(self.t.spec.preload), "warm": self.t.spec.warm,
                 "cgroup": str(self.t.cgroup.template) if self.t.cgroup else None,
                 "also": [str(m) for m in cgroup_mirrors(self.t.cgroup.template)]
                 if self.t.cgroup else []}
        ours.send(wire.encode(order))
        self.t.on(Event.SPAWNED)
        self.task = asyncio.ensure_future(self._watch(ours, proc, self.pidfd))

    def _place(self, proc: subprocess.Popen[bytes]) -> None:
        """Move a template of another account into its leaf (and v1 mirrors) before it
        is told to warm: its own join from fiberd's cgroup would need write access
        where only root has it. Its join then finds it there. A failed move is left to
        that join, which reports it as the warm's failure."""
        assert self.t.cgroup is not None
        for group in (*cgroup_mirrors(self.t.cgroup.template), self.t.cgroup.template):
            try:
                cgroup_join(group, proc.pid)
            except OSError as err:
                log.warning("template of %s: cannot place it in %s: %s", self.t.uid, group,
                            err.strerror)
                return

    async def _watch(self, sock: socket.socket, proc: subprocess.Popen[bytes],
                     pidfd: int) -> None:
        """Serve one template process's messages until it dies, then account and re-warm.

        Guarded meanwhile (``_guard``). Its death is its pidfd's: a descendant that
        inherited the socket cannot keep fiberd waiting for end of file.
        """
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()

        def readable() -> None:  # every message waiting, in order, then back to the loop
            try:
                while True:
                    data, fds, _, _ = socket.recv_fds(sock, wire.MAX_MESSAGE + 1, 1,
                                                      socket.MSG_CMSG_CLOEXEC)
                    if not data:
                        break
                    try:
                        msg = wire.decode(data)
                    except wire.WireError:
                        msg = {"t": "unreadable"}
                    self.t.talk.dispatch(msg, fds)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionError:
                pass
            if not closed.done():
                closed.set_result(None)

        loop.add_reader(sock.fileno(), readable)
        guard = asyncio.ensure_future(self._guard(proc.pid))
        try:
            if not await first_done(closed, pidfd_wait(pidfd)):
                readable()  # it died: take what it sent before
            else:  # it closed its end: it is exiting, or must be made to
                dying = asyncio.ensure_future(pidfd_wait(pidfd))
                if not await first_done(dying, self.t.clock.sleep(self.t.timeout)):
                    self.t.on(Event.STALLED, f"still running {self.t.timeout:g} s after "
                             "closing its socket")
                    self.kill()  # also when it was not ready (a failed warm)
                await dying
        finally:
            loop.remove_reader(sock.fileno())
            guard.cancel()
        await pidfd_wait(pidfd)
        self.kill()  # what it left in its process group or cgroup leaf
        for link in list(self.t.windows.values()):
            link.gone()  # its windows' leaves killed, what no report told learnt from them
        self.t.windows.clear()
        status = proc.wait()
        os.close(pidfd)
        sock.close()
        self.sock = self.pidfd = None
        self.t.on(Event.EXITED, status=status)
        while self.t.life.phase is Phase.REWARMING:
            await self.t.clock.sleep(self.t.life.delay)
            if self.t.life.phase is not Phase.REWARMING:
                return  # stopped meanwhile
            try:
                self.spawn()
                return
            except OSError as err:
                self.t.on(Event.SPAWN_FAILED, str(err))
                log.error("template %s: %s", self.t.uid, self.t.last_fault)

    async def _guard(self, pid: int) -> None:
        """Give the template process up (STALLED) once ``stall.judge`` says it stalled:
        a spare request unanswered, or the process stopped, for ``timeout`` seconds on
        the clock while fiberd was watching. Runs until cancelled (by ``_watch``) or it
        gives up on it."""
        every = stall.look_every(self.t.timeout)
        stopped_since: float | None = None
        watching = last_look = self.t.clock.mono()
        while True:
            now = self.t.clock.mono()
            if stall.gap(last_look, now, every):
                watching = now
            last_look = now
            if not stopped(pid):
                stopped_since = None
            elif stopped_since is None:
                stopped_since = now
            asked = min((t for p in self.t.keeper.pools.values()
                         if (t := p.oldest_ask()) is not None), default=None)
            seen = stall.Seen(asked, stopped_since, watching)
            verdict = stall.judge(seen, now, self.t.timeout, every)
            if verdict.reason is not None:
                self.t.on(Event.STALLED, verdict.reason)
                return
            await self.t.clock.sleep(verdict.recheck)

    def kill(self) -> None:
        """SIGKILL the template process, its process group (it leads one) and, carved, all
        in its cgroup leaf. Its spares and fibers die by their death signal. Never raises."""
        if self.pidfd is None or self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # unreaped, its pid cannot be reused
        if self.t.cgroup is not None and populated(self.t.cgroup.template):
            with contextlib.suppress(OSError):
                cgroup_kill(self.t.cgroup.template)

    def ask_reap(self, pid: int) -> None:
        """Ask the template process to reap fiber ``pid`` now: its exit outran its report
        (``LateReports``). Best effort: a full socket or a gone template drops the ask,
        and the template's own walk of its children still finds the fiber."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.send(wire.encode({"t": "reap", "pid": pid}))
