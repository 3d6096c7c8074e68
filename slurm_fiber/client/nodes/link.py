"""The first node's end of one relay: connections to another node's fiberd, over srun.

``Link(node)`` starts ``srun --overlap --quiet --nodelist=NODE --nodes=1 --ntasks=1
python -m slurm_fiber.client.nodes.relay`` (the interpreter running here, so the same package
on a node that sees the same paths) with its stdin and stdout as pipes, and speaks
nodes/wire.py on them. ``open(timeout)`` gives one connection to that node's fiberd as
a ``FiberdClient`` on one end of a local socket pair: a pump thread reads what the
client sends there (descriptors and all), keeps the descriptors of a clone's stdio here
and passes the frame on; the reader thread passes fiberd's frames back, writes the
``output`` lines into the kept descriptors before the event that follows them, and
closes them once done. So a ``TaskRunner`` (``opener=link.open``) works unchanged.

Why one srun per node: srun gives its stdin to all tasks of a step or to one
(``--input=all|none|TASKID``), and its per-task file patterns (``%t``, ``%n``, ``%N``)
are opened on the node that runs the task: one step cannot give each task a stream of
its own from this process. One single-task step per node can (Slurm 22.05 of Debian 12
and later alike).

Guarantees: the link is dead (``dead`` says why) once the relay's stdout ends or breaks
the wire (srun or the relay ended, the node was lost); then every open connection ends
(its client reads the end: ``Unreachable``) and ``open`` raises Unreachable without
waiting; a connection the relay could not make raises Unreachable whose cause is the
OSError the relay met (so a runner's wait for a fiberd not listening yet works as here),
an untrusted server ``UntrustedServer``. ``close`` ends srun within CLOSE_WAIT seconds
(stdin closed, then SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

from slurm_fiber.client.connection import FiberdClient, Unreachable
from slurm_fiber.client.nodes.wire import MAX_LINE, WireError, clone_items, decode, encode
from slurm_fiber.client.tasks import UntrustedServer
from slurm_fiber.protocol.framing import FrameDecoder, FramingError, encode_frame

OPEN_WAIT = 120.0  # seconds an open waits for the relay's answer (srun's step start)
CLOSE_WAIT = 5.0
ANCILLARY = socket.CMSG_SPACE(256 * 4)  # a batch's descriptors (192 at most) and room


class _Channel:
    def __init__(self, number: int, ours: socket.socket) -> None:
        self.number, self.ours = number, ours
        self.answered = threading.Event()
        self.answer: dict[str, object] = {}
        self.requests = 0
        self.kept: dict[tuple[int, str | None], dict[str, int]] = {}
        self.lock = threading.Lock()

    def end(self) -> None:
        """No more frames to the client: it reads the end."""
        with contextlib.suppress(OSError):
            self.ours.shutdown(socket.SHUT_WR)

    def free(self) -> None:
        with self.lock:
            kept, self.kept = self.kept, {}
        for fds in kept.values():
            for fd in fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)


class Link:
    """One relay on ``node`` (see the module doc)."""

    def __init__(self, node: str, socket_path: str | None = None,
                 server_uids: Sequence[int] | None = None,
                 command: Sequence[str] | None = None) -> None:
        self.node = node
        self.server_uids = sorted(server_uids) if server_uids is not None else None
        self.dead: str | None = None
        self.channels: dict[int, _Channel] = {}
        self.lock = threading.Lock()  # channels, numbering, writes to the relay
        self.numbered = 0
        relay = [sys.executable, "-m", "slurm_fiber.client.nodes.relay",
                 *(["--socket", socket_path] if socket_path else [])]
        argv = list(command) if command is not None else [
            "srun", "--overlap", "--quiet", f"--nodelist={node}", "--nodes=1",
            "--ntasks=1", "--kill-on-bad-exit=0", *relay]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     close_fds=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.to_relay = self.proc.stdin
        self.reader = threading.Thread(target=self._read, daemon=True,
                                       name=f"slurm-fiber-link-{node}")
        self.reader.start()

    # ------------------------------------------------------------ public

    def open(self, timeout: float | None = 30.0) -> FiberdClient:
        """A new connection to the node's fiberd (blocks for the relay's answer). Raises
        Unreachable (UntrustedServer)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with self.lock:
            if self.dead is not None:
                ours.close()
                theirs.close()
                raise Unreachable(f"node {self.node} is lost: {self.dead}")
            self.numbered += 1
            channel = _Channel(self.numbered, ours)
            self.channels[channel.number] = channel
        try:
            self._send(channel.number, "open", {"server_uids": self.server_uids})
            if not channel.answered.wait(OPEN_WAIT):
                raise Unreachable(f"the relay on {self.node} did not answer in "
                                  f"{OPEN_WAIT:g} s")
            answer = channel.answer
            if answer.get("kind") != "opened":
                reason = str(answer.get("reason") or f"node {self.node} is lost")
                if answer.get("untrusted"):
                    raise UntrustedServer(reason)
                errno = answer.get("errno")
                cause = OSError(errno, reason) if isinstance(errno, int) and errno else None
                raise Unreachable(reason) from cause
        except BaseException:
            self._forget(channel)
            theirs.close()
            raise
        threading.Thread(target=self._pump, args=(channel,), daemon=True,
                         name=f"slurm-fiber-link-{self.node}-{channel.number}").start()
        return FiberdClient(f"{self.node}:fiberd", timeout=timeout, sock=theirs)

    def close(self) -> None:
        """End the relay and srun (bounded: CLOSE_WAIT s, then SIGTERM, then SIGKILL)."""
        with self.lock:
            if self.dead is None:
                self.dead = "the map closed it"
        with contextlib.suppress(OSError):
            self.to_relay.close()
        for signal_it in (None, self.proc.terminate, self.proc.kill):
            if signal_it is not None:
                with contextlib.suppress(OSError):
                    signal_it()
            try:
                self.proc.wait(CLOSE_WAIT)
                break
            except subprocess.TimeoutExpired:
                continue
        self.reader.join(CLOSE_WAIT)

    # ------------------------------------------------------------ threads

    def _send(self, number: int, kind: str, body: dict[str, object]) -> None:
        """One line to the relay. Raises Unreachable once it is gone."""
        line = encode(number, kind, body)
        with self.lock:
            if self.dead is not None and kind != "close":
                raise Unreachable(f"node {self.node} is lost: {self.dead}")
            try:
                self.to_relay.write(line)
                self.to_relay.flush()
            except (OSError, ValueError) as err:
                raise Unreachable(f"the relay on {self.node} is gone: {err}") from err

    def _pump(self, channel: _Channel) -> None:
        """The client's frames to the relay, its stdio descriptors kept here."""
        decoder = FrameDecoder()
        try:
            while True:
                data, fds, _flags, _addr = socket.recv_fds(channel.ours, 1 << 16, 256)
                if not data:
                    break
                decoder.feed(data, fds)
                while (frame := decoder.next_frame()) is not None:
                    if not isinstance(frame.body, dict):
                        frame.close_fds()
                        continue
                    self._keep(channel, frame.body, frame.fds)
                    frame.fds.clear()
                    self._send(channel.number, "frame", frame.body)
        except (OSError, FramingError, Unreachable):
            pass
        finally:
            decoder.close()
            with contextlib.suppress(Unreachable):
                self._send(channel.number, "close", {})
            self._forget(channel)
            channel.ours.close()

    def _keep(self, channel: _Channel, body: dict[str, object], fds: list[int]) -> None:
        """Keep a clone request's stdout/stderr descriptors (by request and key)."""
        items = clone_items(body)
        given = iter(fds)
        if items is not None:
            with channel.lock:
                channel.requests += 1
                for key, names in items:
                    kept = channel.kept.setdefault((channel.requests, key), {})
                    for name in names:
                        fd = next(given, None)
                        if fd is not None and name != "stdin":
                            kept[name] = fd
                        elif fd is not None:
                            os.close(fd)  # (the relay gives the fiber /dev/null)
        for fd in given:
            os.close(fd)

    def _read(self) -> None:
        """The relay's lines: frames to their client, output to kept descriptors."""
        reason = "the relay ended (srun or the node is gone)"
        stream = self.proc.stdout
        assert stream is not None
        try:
            while line := stream.readline(MAX_LINE + 1):
                if not line.endswith(b"\n"):
                    reason = "the relay's stream was cut or broke the wire"
                    break
                number, kind, body = decode(line[:-1])
                with self.lock:
                    channel = self.channels.get(number)
                if channel is not None:
                    self._deliver(channel, kind, body)
        except (OSError, WireError, ValueError) as err:
            reason = f"the relay's stream broke: {err}"
        with self.lock:
            if self.dead is None:
                self.dead = reason
            channels = list(self.channels.values())
        for channel in channels:
            channel.answer = {"kind": "refused", "reason": f"node {self.node} is lost: "
                              f"{self.dead}"}
            channel.answered.set()
            channel.end()
            channel.free()

    def _deliver(self, channel: _Channel, kind: str, body: dict[str, object]) -> None:
        if kind in ("opened", "refused"):
            channel.answer = {**body, "kind": kind}
            channel.answered.set()
        elif kind == "frame":
            with contextlib.suppress(OSError):  # the client left: its pump ends the channel
                channel.ours.sendall(encode_frame(body, 1 << 30))
        elif kind == "output":
            self._output(channel, body)
        elif kind == "closed":
            channel.end()

    @staticmethod
    def _output(channel: _Channel, body: dict[str, object]) -> None:
        req, key = body.get("req"), body.get("key")
        place = (req if isinstance(req, int) else -1, None if key is None else str(key))
        with channel.lock:
            kept = channel.kept.get(place)
            if kept is not None and body.get("done"):
                del channel.kept[place]
        if kept is None:
            return
        if body.get("done"):
            for fd in kept.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            return
        out = kept.get(str(body.get("name")))
        if out is None:
            return
        data = memoryview(base64.b64decode(str(body.get("data") or "")))
        with contextlib.suppress(OSError):
            while data:
                data = data[os.write(out, data):]

    def _forget(self, channel: _Channel) -> None:
        with self.lock:
            self.channels.pop(channel.number, None)
        channel.free()
