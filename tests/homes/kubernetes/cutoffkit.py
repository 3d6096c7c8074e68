"""A loopback TCP relay that can cut a client off from its API server while the server lives on.

``Cutoff(port)`` listens on 127.0.0.1 and relays every connection, byte for
byte (TLS passes through untouched), to 127.0.0.1:``port``. ``cut`` closes the
listener and every relayed connection (the client sees connection refused,
as a node partitioned from its control plane does) while the server keeps
serving others; ``mend`` listens again on the same port. Threads only;
every blocking call is bounded by a socket timeout or a close.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class Cutoff:
    """A relay to 127.0.0.1:``port``: ``mend`` starts it, ``cut``/``mend`` partition it."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.port = 0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def mend(self) -> Cutoff:
        """Listen (again, on the same port) and relay. Idempotent."""
        with self._lock:
            if self._listener is not None:
                return self
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            self.port = listener.getsockname()[1]
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def cut(self) -> None:
        """Refuse new connections and drop the relayed ones."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._open = self._open, set()
        for sock in ([listener] if listener else []) + list(conns):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    close = cut

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._open |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(None)
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._open -= {src, dst}
            src.close()
