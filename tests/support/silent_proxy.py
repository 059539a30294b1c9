"""A TCP relay on loopback in front of a real store, that can go silent the way a partitioned link does: it keeps every
connection open and reads what the client sends, but nothing reaches the store and no answer comes back. ``hold``
keeps what it read and delivers it when the link returns (TCP's retransmissions after a short flap); ``drop`` throws
it away (a link that never returns: the client waits until TCP gives up)."""
from __future__ import annotations

import socket
import threading
from typing import List, Tuple


class SilentProxy:
    """Listens on 127.0.0.1:``port`` (read it after ``start``) and relays each connection to ``target``."""

    def __init__(self, target: Tuple[str, int]) -> None:
        self.target = target
        self.mode = "open"  # "open", "hold" or "drop"
        self._changed = threading.Condition()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: List[socket.socket] = [self._listener]
        self._closed = False

    def start(self) -> "SilentProxy":
        threading.Thread(target=self._accept, daemon=True, name="silent-proxy").start()
        return self

    def set_mode(self, mode: str) -> None:
        assert mode in ("open", "hold", "drop")
        with self._changed:
            self.mode = mode
            self._changed.notify_all()

    def close(self) -> None:
        self._closed = True
        self.set_mode("open")
        for sock in self._sockets:
            try:
                sock.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._sockets += [client, upstream]
            threading.Thread(target=self._relay, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            with self._changed:  # held: this relay waits, and what comes after stays in the kernel's buffers
                self._changed.wait_for(lambda: self.mode != "hold")
                mode = self.mode
            if mode == "drop":
                continue
            try:
                sink.sendall(data)
            except OSError:
                return
