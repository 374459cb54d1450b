"""A TCP link for tests that can go silent while it stays open: :class:`SilentLink`.

What a paused pooler, a stalled proxy or a server frozen on its disk does to a client: every
socket stays connected and is acknowledged by the kernel, and nothing answers. No reset, no
refusal, no retransmission timeout: a keepalive or ``tcp_user_timeout`` never fires, so only a
deadline kept by the caller ends a call made on it. A network partition
(:mod:`.partitions`) is the other shape, where the kernel does give up.

The link forwards between a local port and a target. :meth:`SilentLink.silence` stops
forwarding both ways at once (data already read is held, not dropped; new connections are
accepted and held); :meth:`SilentLink.resume` delivers what was held and forwards again.
"""

from __future__ import annotations

import contextlib
import socket
import threading

CHUNK = 65536


class SilentLink:
    """Forwards ``127.0.0.1:<port>`` to ``target``; can be silenced and resumed."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.connections = 0
        threading.Thread(target=self._accept, name=f"silent-link-{self.port}",
                         daemon=True).start()

    def url_for(self, url: str) -> str:
        """``url`` with its ``host:port`` replaced by this link's."""
        host, port = self.target
        return url.replace(f"{host}:{port}", f"127.0.0.1:{self.port}", 1)

    @property
    def silent(self) -> bool:
        return not self._open.is_set()

    def silence(self) -> None:
        """Stop answering: every connection stays open, nothing goes through either way."""
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed = True
        self._open.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        self._open.wait()  # a connection made while silent is held, as a paused pooler does
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            if self._closed:
                upstream.close()
                client.close()
                return
            self._sockets += [client, upstream]
            self.connections += 1
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                self._open.wait()
                data = src.recv(CHUNK)
                if not data:
                    break
                self._open.wait()  # read while it went silent: held until it resumes
                if self._closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


__all__ = ["SilentLink"]
