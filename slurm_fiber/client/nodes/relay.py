"""``python -m slurm_fiber.client.nodes.relay``: this node's fiberd, served on stdin and stdout.

The first node of a job starts one relay per other node with ``srun --overlap
--nodelist=NODE --nodes=1 --ntasks=1`` (nodes/link.py) and speaks nodes/wire.py on its
stdin and stdout: Slurm carries the stream (munge-authenticated, between the job's own
steps), so nothing listens on the network and no credential is added. The relay opens
one connection to the fiberd of the node it runs on (found as fiberctl finds it:
``--socket``, ``$FIBERD_SOCKET``, the job's fiberd on this node) per channel the link
opens, and passes the socket protocol's frames both ways unchanged but for
descriptors, which cannot cross nodes: for each stdio name a clone or batch item gives,
it passes fiberd a descriptor of its own (stdin: /dev/null; stdout, stderr: anonymous
memory files), sends what the fiber wrote back as ``output`` lines (up to the call's
result with a ``result`` event, the rest before the fiber's ``exit`` event is passed
on) and closes them once the item is done.

Guarantees: a channel is served only by a fiberd whose uid (SO_PEERCRED) is one the
link named (when it named any); a fiberd that closes a connection closes that channel
(``closed``), whose client then sees fiberd gone; a link that closes a channel closes
its connection (fiberd sends the fibers it waited for SIGHUP, the clone's ``hangup``);
the relay ends when its stdin ends or stdout breaks, closing every connection. It never
reads a descriptor a peer sent and holds a fiber's output only in the memory file the
fiber writes. Not bounded here: how much a fiber writes (its memory file is charged to
this relay's step).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import select
import selectors
import socket
import struct
import sys
from collections import deque
from collections.abc import Sequence

from slurm_fiber.client.discovery import discover_socket
from slurm_fiber.client.nodes.wire import CHUNK, MAX_LINE, WireError, clone_items, decode, encode
from slurm_fiber.protocol.framing import FrameDecoder, FramingError, encode_frame
from slurm_fiber.protocol.limits import DEFAULT_MAX_FRAME, MAX_REPLY

PEERCRED = struct.Struct("3i")
MAX_REQUEST = DEFAULT_MAX_FRAME  # what fiberd takes


class Item:
    """One clone's (or batch item's) descriptors here: name → fd, and what was sent."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self.sent: dict[str, int] = {}


class Stream:
    """One clone or clone_batch request on a channel and its stream of replies."""

    def __init__(self, n: int, rid: object) -> None:
        self.n, self.rid = n, rid
        self.items: dict[str | None, Item] = {}
        self.fibers: dict[str, str | None] = {}  # fiber id → item key


class Channel:
    def __init__(self, number: int, sock: socket.socket) -> None:
        self.number, self.sock = number, sock
        self.decoder = FrameDecoder(MAX_REPLY)
        self.requests = 0
        self.streams: deque[Stream] = deque()


class Relay:
    """The relay's loop (see the module doc)."""

    def __init__(self, path: str, node: str, stdin: int = 0, stdout: int = 1) -> None:
        self.path, self.node = path, node
        self.stdin, self.stdout = stdin, stdout
        self.channels: dict[int, Channel] = {}
        self.selector = selectors.DefaultSelector()
        self.pending = bytearray()

    def run(self) -> int:
        """Serve until stdin ends; the exit status."""
        os.set_blocking(self.stdin, False)
        self.selector.register(self.stdin, selectors.EVENT_READ, None)
        try:
            while True:
                for key, _ in self.selector.select():
                    if key.data is None:
                        if not self.from_link():
                            return 0
                    else:
                        self.from_fiberd(key.data)
        except BrokenPipeError:
            return 0  # the link is gone: nobody to serve
        except WireError as err:
            self.say(f"the link broke the wire: {err}")
            return 1
        finally:
            for channel in list(self.channels.values()):
                self.close(channel, None)

    # ------------------------------------------------------------ link → fiberd

    def from_link(self) -> bool:
        """Read stdin; act on each whole line. False at its end."""
        try:
            data = os.read(self.stdin, 1 << 16)
        except BlockingIOError:
            return True
        if not data:
            return False
        self.pending += data
        while (end := self.pending.find(b"\n")) >= 0:
            line = bytes(self.pending[:end])
            del self.pending[:end + 1]
            self.line(*decode(line))
        if len(self.pending) > MAX_LINE:
            raise WireError(f"a line longer than {MAX_LINE} bytes")
        return True

    def line(self, number: int, kind: str, body: dict[str, object]) -> None:
        channel = self.channels.get(number)
        if kind == "open" and channel is None:
            self.open(number, body.get("server_uids"))
        elif kind == "frame" and channel is not None:
            self.request(channel, body)
        elif kind == "close" and channel is not None:
            self.close(channel, None)

    def open(self, number: int, uids: object) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
            if isinstance(uids, list):
                _pid, uid, _gid = PEERCRED.unpack(sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
                if uid not in uids:
                    sock.close()
                    self.send(number, "refused", {
                        "errno": 0, "untrusted": True,
                        "reason": f"the server at {self.path} on {self.node} runs as uid "
                                  f"{uid}, not {' or '.join(map(str, sorted(uids)))}"})
                    return
        except OSError as err:
            sock.close()
            self.send(number, "refused", {"errno": err.errno or 0, "reason": (
                f"cannot connect to fiberd at {self.path} on {self.node}: "
                f"{err.strerror or err}")})
            return
        channel = Channel(number, sock)
        self.channels[number] = channel
        self.selector.register(sock, selectors.EVENT_READ, channel)
        self.send(number, "opened", {"node": self.node})

    def request(self, channel: Channel, body: dict[str, object]) -> None:
        """Pass one request to fiberd, with descriptors of this node for its stdio."""
        items = clone_items(body)
        fds: list[int] = []
        passed: list[int] = []  # closed once sent: fiberd holds its own copies
        if items is not None:
            channel.requests += 1
            stream = Stream(channel.requests, body.get("id"))
            for key, names in items:
                item = stream.items.setdefault(key, Item())
                for name in names:
                    if name == "stdin":
                        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                        passed.append(fd)
                    else:
                        fd = item.fds[name] = os.memfd_create(f"relay-{name}")
                        item.sent[name] = 0
                    fds.append(fd)
            channel.streams.append(stream)
        try:
            data = encode_frame(body, MAX_REQUEST)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
            sent = channel.sock.sendmsg([data], rights) if fds else 0
            channel.sock.sendall(data[sent:])
        except (OSError, ValueError) as err:
            self.close(channel, f"sending to fiberd failed: {err}")
        finally:
            for fd in passed:
                os.close(fd)

    # ------------------------------------------------------------ fiberd → link

    def from_fiberd(self, channel: Channel) -> None:
        try:
            data = channel.sock.recv(1 << 16)
        except OSError as err:
            self.close(channel, f"reading from fiberd failed: {err.strerror or err}")
            return
        if not data:
            self.close(channel, "fiberd closed the connection")
            return
        channel.decoder.feed(data)
        try:
            while (frame := channel.decoder.next_frame()) is not None:
                if isinstance(frame.body, dict):
                    self.reply(channel, frame.body)
        except FramingError as err:
            self.close(channel, f"fiberd broke the protocol: {err.reason}")

    def reply(self, channel: Channel, body: dict[str, object]) -> None:
        """Book and pass on one reply or event (the output it completes first)."""
        head = channel.streams[0] if channel.streams else None
        event = body.get("event")
        result = body.get("result") if isinstance(body.get("result"), dict) else {}
        assert isinstance(result, dict)
        if head is not None:
            if event == "started":
                fiber = result.get("fiber")
                if isinstance(fiber, dict):
                    head.fibers[str(fiber.get("id"))] = None
                entries = result.get("items")
                for entry in entries if isinstance(entries, list) else []:
                    if not isinstance(entry, dict):
                        continue
                    key = str(entry.get("key"))
                    started = entry.get("fiber")
                    if isinstance(started, dict):
                        head.fibers[str(started.get("id"))] = key
                    else:
                        self.output(channel, head, key, done=True)
            elif event == "cancelled":
                keys = result.get("keys")
                for key in keys if isinstance(keys, list) else []:
                    self.output(channel, head, str(key), done=True)
            elif event in ("result", "exit"):
                fid = str(result.get("fiber_id"))
                if fid in head.fibers:
                    self.output(channel, head, head.fibers[fid], done=event == "exit")
        self.send(channel.number, "frame", body)
        if head is not None and body.get("final") and body.get("id") == head.rid:
            for left in list(head.items):
                self.output(channel, head, left, done=True)
            channel.streams.popleft()

    def output(self, channel: Channel, stream: Stream, key: str | None, done: bool) -> None:
        """Send what the item's fiber wrote since last time; with ``done``, its end."""
        item = stream.items.get(key)
        if item is None:
            return
        for name, fd in item.fds.items():
            while chunk := os.pread(fd, CHUNK, item.sent[name]):
                item.sent[name] += len(chunk)
                self.send(channel.number, "output", {
                    "req": stream.n, "key": key, "name": name,
                    "data": base64.b64encode(chunk).decode()})
        if done:
            for fd in item.fds.values():
                os.close(fd)
            del stream.items[key]
            self.send(channel.number, "output", {"req": stream.n, "key": key, "done": True})

    def close(self, channel: Channel, reason: str | None) -> None:
        """End a channel: its connection closed, its items' output ended; with a
        ``reason`` (fiberd's side ended it), the link is told."""
        self.channels.pop(channel.number, None)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(channel.sock)
        channel.sock.close()
        for stream in channel.streams:
            for key in list(stream.items):
                if reason is None:
                    for fd in stream.items.pop(key).fds.values():
                        os.close(fd)
                else:
                    self.output(channel, stream, key, done=True)
        channel.streams.clear()
        if reason is not None:
            self.send(channel.number, "closed", {"reason": f"{reason} (on {self.node})"})

    def send(self, number: int, kind: str, body: dict[str, object]) -> None:
        data = memoryview(encode(number, kind, body))
        while data:
            try:
                data = data[os.write(self.stdout, data):]
            except BlockingIOError:  # (stdout shares stdin's file: a socket)
                select.select([], [self.stdout], [], 1.0)

    def say(self, line: str) -> None:
        print(f"slurm_fiber relay on {self.node}: {line}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm_fiber.client.nodes.relay",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-S", "--socket", help="fiberd's socket (default: as fiberctl finds "
                        "it on this node)")
    opts = parser.parse_args(argv)
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    return Relay(discover_socket(opts.socket), node).run()


if __name__ == "__main__":
    sys.exit(main())
