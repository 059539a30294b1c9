"""The authenticating relay in front of a multi-node job's store: nothing for a client that lacks the job secret.

torch's TCPStore serves any client that connects, and has no hook for a handshake. So node 0's supervisor keeps
the real store on loopback and puts :class:`RelayServer` on the peer-facing address; every other node's supervisor
runs a :class:`RelayClient` on its own loopback, which its supervisor and ranks use as if it were the store. Each
connection the client relay opens to node 0 first proves the secret both ways:

1. the server sends ``FLR1`` + a 32-byte nonce ``ns``;
2. the client sends ``FLR1`` + its nonce ``nc`` + HMAC-SHA256(secret, "client" + ns + nc);
3. the server checks it (constant time) and sends HMAC-SHA256(secret, "server" + nc + ns); the client checks it.

Only then are bytes piped to and from the store. A fresh nonce on each side makes a recorded handshake useless
on another connection; the secret itself never crosses the network. A server-side connection that sends more than
the 68 handshake bytes, first bytes that are not ``FLR1`` (another protocol's, as a bare TCPStore client's), a wrong
proof, or no proof within ``HANDSHAKE_S`` is closed having received nothing, and at
most ``MAX_UNPROVEN`` connections wait for their proof at once (a new one beyond that is closed at once), so a flood
costs node 0 at most that many 68-byte buffers. After the handshake the stream is plain TCP, as torch's own: an
attacker on the path who can inject into a TCP stream is out of scope (docs/security.md: WireGuard or IPsec).

Each relay runs one thread of non-blocking sockets (``selectors``); piped data is buffered up to ``BUFFER_LIMIT`` per
direction, then reading pauses. Same floor as rendezvous: imports only it.
"""
from __future__ import annotations

import errno
import hmac
import os
import selectors
import socket
import threading
import time
from hashlib import sha256
from typing import Callable, Dict, List, Optional, Tuple

from fabriclite.distributed import rendezvous

MAGIC = b"FLR1"
NONCE_BYTES = 32
MAC_BYTES = 32
HELLO_BYTES = len(MAGIC) + NONCE_BYTES
PROOF_BYTES = len(MAGIC) + NONCE_BYTES + MAC_BYTES
#: seconds a client has, from its accept, to prove the secret to node 0's relay
HANDSHAKE_S = 1.0
#: connections that may wait for their proof at once
MAX_UNPROVEN = 64
#: bytes buffered per direction of a piped connection before its reading pauses
BUFFER_LIMIT = 4 << 20
_CHUNK = 1 << 16


class JobSecretRefused(rendezvous.RendezvousError):
    """node 0's relay refused this node's proof of the job secret, or answered with a wrong one (meeting failed:
    the message names node 0's address and the job secret)."""


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, sha256).digest()


def client_proof(secret: bytes, hello: bytes) -> Tuple[bytes, bytes]:
    """The client's answer to the server's ``hello`` and the server proof it then expects. ValueError when
    ``hello`` is not a relay's."""
    if len(hello) != HELLO_BYTES or not hello.startswith(MAGIC):
        raise ValueError("not a fabriclite relay")
    server_nonce, nonce = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
    return (MAGIC + nonce + _mac(secret, b"client", server_nonce, nonce),
            _mac(secret, b"server", nonce, server_nonce))


def verify_secret(address: str, port: int, secret: bytes, timeout_s: float) -> None:
    """Prove ``secret`` to the relay at ``address:port`` once (a connection that is then closed), waiting in Python
    until it listens (signals are handled meanwhile). RendezvousError when nothing answers within ``timeout_s`` or
    what answers is no relay; JobSecretRefused, naming the address and the job secret, when the relay refuses the
    proof or proves another secret."""
    from datetime import timedelta

    where = f"{address}:{port}"
    handshake_s = rendezvous.reach(address, port, timedelta(seconds=timeout_s))
    try:
        with socket.create_connection((address, port), timeout=handshake_s) as sock:
            hello = _read_exactly(sock, HELLO_BYTES)
            try:
                proof, expected = client_proof(secret, hello)
            except ValueError:
                raise rendezvous.RendezvousError(rendezvous.not_a_store(
                    address, port, "it is no job store with a job secret: was node 0 given --job-secret-file "
                                   "too?")) from None
            sock.sendall(proof)
            answer = _read_exactly(sock, MAC_BYTES)
    except socket.timeout:
        raise rendezvous.RendezvousError(rendezvous.not_a_store(
            address, port, f"no answer to the handshake within {handshake_s:.0f} s")) from None
    except (ConnectionError, EOFError):
        raise JobSecretRefused(
            f"fabriclite: node 0's store at {where} refused this node's job secret: every node must be given the "
            f"same file (--job-secret-file / $FABRICLITE_JOB_SECRET_FILE, docs/security.md)") from None
    if not hmac.compare_digest(answer, expected):
        raise JobSecretRefused(f"fabriclite: node 0's store at {where} proved another job secret than this node's: "
                               f"every node must be given the same file (--job-secret-file)")


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise EOFError("closed")
        data += chunk
    return data


class _Link:
    """One relayed connection: ``front`` was accepted, ``back`` leads on (to the store, or to node 0's relay)."""

    def __init__(self, front: socket.socket, peer: str, state: str, deadline: float) -> None:
        self.front, self.back = front, None  # type: socket.socket, Optional[socket.socket]
        self.peer, self.state, self.deadline = peer, state, deadline
        self.to_front, self.to_back = bytearray(), bytearray()
        self.inbox = bytearray()  # handshake bytes read so far
        self.held = bytearray()  # a client link's rank bytes read before it opened
        self.expected = b""  # the proof the other side must send (client relay: the server's)
        self.nonce = b""  # the server relay's nonce


class _Relay:
    """The loop both relays share: a listening socket, links, one thread. Subclasses say how a link starts and
    how its handshake goes."""

    def __init__(self, listening: socket.socket, name: str) -> None:
        self.listening = listening
        self.port: int = listening.getsockname()[1]
        self.links: Dict[int, Tuple[_Link, str]] = {}  # fileno -> (link, "front" | "back")
        #: front fileno -> link, for the links whose handshake has not finished: what the loop's deadlines and the
        #: cap on unproven connections look at, so that no request costs work in the number of open links
        self._unproven: Dict[int, _Link] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._closed = False
        listening.setblocking(False)
        self._selector.register(listening, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while not self._closed:
            timeout = 0.1
            if self._unproven:
                now = time.monotonic()
                timeout = max(0.0, min(timeout, min(link.deadline for link in self._unproven.values()) - now))
            for key, events in self._selector.select(timeout):
                if key.data == "listen":
                    self._accept_all()
                elif key.data == "wake":
                    return
                else:
                    entry = self.links.get(key.fd)
                    if entry is not None:
                        self._service(entry[0], entry[1], events)
            if self._unproven:
                now = time.monotonic()
                for link in [link for link in self._unproven.values() if now >= link.deadline]:
                    self._expired(link)

    def _accept_all(self) -> None:
        while True:
            try:
                sock, peer = self.listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):  # a request's pieces go on at once, as torch's do
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
            if len(self._unproven) >= MAX_UNPROVEN:
                self._refused(where, f"more than {MAX_UNPROVEN} connections waiting for their proof")
                sock.close()
                continue
            self._start(sock, where)

    def _service(self, link: _Link, side: str, events: int) -> None:
        try:
            if events == selectors.EVENT_READ and link.state == "open" and self._pipe(link, side):
                return
            if events & selectors.EVENT_WRITE:
                self._writable(link, side)
            if events & selectors.EVENT_READ and self._link_alive(link):
                self._readable(link, side)
        except (BlockingIOError, InterruptedError):  # a stale event (its fd was closed and reused meanwhile)
            pass
        except OSError:  # reset, refused, unreachable: the link ends, as the connection would without a relay
            self._close(link)
            return
        if self._link_alive(link):
            self._watch(link)

    def _pipe(self, link: _Link, side: str) -> bool:
        """The common case of an open link, a request or its answer to pass on while nothing waits to be sent
        that way: read it and send it on at once, leaving what the sockets wait for as it was unless the other
        side took only part. False (nothing done) when bytes already wait that way."""
        sock, other, pending = ((link.front, link.back, link.to_back) if side == "front"
                                else (link.back, link.front, link.to_front))
        if pending or other is None:
            return False
        data = sock.recv(_CHUNK)
        if not data:
            self._close(link)
            return True
        try:
            sent = other.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):
            pending.extend(data[sent:])
            self._watch(link)
        return True

    def _writable(self, link: _Link, side: str) -> None:
        if side == "back" and link.state == "connecting":
            err = link.back.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
            link.state = "hello"
            return
        sock, pending = (link.front, link.to_front) if side == "front" else (link.back, link.to_back)
        if pending:
            sent = sock.send(pending)
            del pending[:sent]

    def _readable(self, link: _Link, side: str) -> None:
        sock = link.front if side == "front" else link.back
        if link.state == "open":
            data = sock.recv(_CHUNK)
            if not data:
                self._close(link)
                return
            (link.to_back if side == "front" else link.to_front).extend(data)
            return
        self._handshake(link, side, sock)

    def _handshake(self, link: _Link, side: str, sock: socket.socket) -> None:
        raise NotImplementedError

    def _gather(self, link: _Link, sock: socket.socket, want: int, most: int) -> Optional[bytes]:
        """Read handshake bytes into ``link.inbox`` (at most ``most`` in all): None until ``want`` have come (or
        when the peer closed: the link is closed), then every byte read, the inbox emptied."""
        data = sock.recv(most - len(link.inbox))
        if not data:
            self._close(link)
            return None
        link.inbox.extend(data)
        if len(link.inbox) < want:
            return None
        received = bytes(link.inbox)
        link.inbox.clear()
        return received

    def _expired(self, link: _Link) -> None:
        self._close(link)

    def _refused(self, peer: str, why: str) -> None:
        """Called on the loop's thread for each connection turned away."""

    # ------------------------------------------------------------------ bookkeeping
    def _link_alive(self, link: _Link) -> bool:
        return link.front.fileno() in self.links

    def _add(self, link: _Link) -> None:
        self.links[link.front.fileno()] = (link, "front")
        if link.state != "open":
            self._unproven[link.front.fileno()] = link
        self._watch(link)

    def _opened(self, link: _Link) -> None:
        """The link's handshake is done: from now on its bytes are piped."""
        link.state = "open"
        self._unproven.pop(link.front.fileno(), None)

    def _attach_back(self, link: _Link, back: socket.socket) -> None:
        link.back = back
        self.links[back.fileno()] = (link, "back")
        self._watch(link)

    def _watch(self, link: _Link) -> None:
        """Set what each of the link's sockets waits for: write while it has bytes it may send (a client link's
        rank bytes only once open) or connects; read while the other direction's buffer has room."""
        state = link.state
        front = selectors.EVENT_WRITE if link.to_front else 0
        if state == "proving" or (state == "open" and len(link.to_back) < BUFFER_LIMIT) or (
                state in ("connecting", "hello", "awaiting") and len(link.held) < BUFFER_LIMIT):
            front |= selectors.EVENT_READ
        self._modify(link.front, front)
        if link.back is not None:
            back = 0
            if state == "connecting" or (link.to_back and state in ("awaiting", "open")):
                back |= selectors.EVENT_WRITE
            if state in ("hello", "awaiting") or (state == "open" and len(link.to_front) < BUFFER_LIMIT):
                back |= selectors.EVENT_READ
            self._modify(link.back, back)

    def _modify(self, sock: socket.socket, events: int) -> None:
        key = self._selector.get_map().get(sock.fileno())
        if events == 0:
            if key is not None:
                self._selector.unregister(sock)
        elif key is None:
            self._selector.register(sock, events, None)
        elif key.events != events:
            self._selector.modify(sock, events, None)

    def _close(self, link: _Link) -> None:
        for sock, pending in ((link.front, link.to_front), (link.back, link.to_back)):
            if sock is None:
                continue
            if pending:
                try:
                    sock.send(pending)  # what the other side said last (its answer before it closed)
                except OSError:
                    pass
            fileno = sock.fileno()
            if self._unproven.get(fileno) is link:
                del self._unproven[fileno]
            if fileno in self.links:
                del self.links[fileno]
                try:
                    self._selector.unregister(sock)
                except (KeyError, ValueError):
                    pass
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop the relay: its thread ends, every connection and the listening socket are closed."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(2.0)
        for link, _ in list(self.links.values()):
            self._close(link)
        for sock in (self.listening, self._wake_r, self._wake_w):
            try:
                sock.close()
            except OSError:
                pass
        self._selector.close()


class RelayServer(_Relay):
    """Node 0's relay: listens on ``address:port`` alone (``rendezvous.listener``; port 0 picks one: read ``port``),
    and pipes each connection that proves ``secret`` to the store at ``target`` (loopback). ``on_refused(peer,
    why)`` is called for each connection turned away (on the relay's thread: keep it short).

    RendezvousError naming the address and port when the port is taken."""

    def __init__(self, address: str, port: int, secret: bytes, target: Tuple[str, int],
                 on_refused: Optional[Callable[[str, str], None]] = None) -> None:
        self.secret, self.target, self.on_refused = secret, target, on_refused
        try:
            sock = rendezvous.listener(address, port)
            if sock is None:  # no single address of this host to bind (see rendezvous.listener): every interface
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("", port))
                sock.listen(socket.SOMAXCONN)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise rendezvous.RendezvousError(rendezvous.port_taken(address, port)) from err
            raise rendezvous.RendezvousError(
                f"fabriclite: could not start the job's store relay on {address}:{port}: {err}") from err
        super().__init__(sock, f"fabriclite-relay-{address}:{sock.getsockname()[1]}")

    def _start(self, sock: socket.socket, peer: str) -> None:
        link = _Link(sock, peer, "proving", time.monotonic() + HANDSHAKE_S)
        link.nonce = os.urandom(NONCE_BYTES)
        link.to_front.extend(MAGIC + link.nonce)
        self._add(link)

    def _handshake(self, link: _Link, side: str, sock: socket.socket) -> None:
        proof = self._gather(link, sock, PROOF_BYTES, PROOF_BYTES + 1)  # one byte more: a flood shows at once
        if proof is None:
            if self._link_alive(link) and not MAGIC.startswith(bytes(link.inbox[:len(MAGIC)])):
                # another protocol's first bytes (a bare TCPStore client's ping): turned away at once
                self._refused(link.peer, "not a handshake")
                link.to_front.clear()
                self._close(link)
            return
        nonce, mac = proof[len(MAGIC):len(MAGIC) + NONCE_BYTES], proof[len(MAGIC) + NONCE_BYTES:PROOF_BYTES]
        if (len(proof) > PROOF_BYTES or not proof.startswith(MAGIC)
                or not hmac.compare_digest(mac, _mac(self.secret, b"client", link.nonce, nonce))):
            self._refused(link.peer, "more bytes than a handshake" if len(proof) > PROOF_BYTES else "a wrong proof")
            link.to_front.clear()
            self._close(link)
            return
        back = socket.create_connection(self.target, timeout=5.0)  # the store on this host's loopback
        back.setblocking(False)
        back.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link.to_front.extend(_mac(self.secret, b"server", nonce, link.nonce))
        self._opened(link)
        self._attach_back(link, back)

    def _expired(self, link: _Link) -> None:
        self._refused(link.peer, f"no proof within {HANDSHAKE_S:g} s")
        link.to_front.clear()
        self._close(link)

    def _refused(self, peer: str, why: str) -> None:
        if self.on_refused is not None:
            try:
                self.on_refused(peer, why)
            except Exception:  # a report must not stop the relay
                pass


class RelayClient(_Relay):
    """A node's relay to node 0's: listens on this host's loopback (read ``port``), and for each connection opens
    one to ``address:port``, proves ``secret`` there and pipes. A connection whose handshake has not finished
    within ``handshake_s`` (node 0 unreachable), or that node 0 refuses, is closed: the store client on it sees
    its store gone."""

    def __init__(self, address: str, port: int, secret: bytes, handshake_s: float = 30.0) -> None:
        self.remote, self.secret, self.handshake_s = (address, port), secret, handshake_s
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(socket.SOMAXCONN)
        super().__init__(sock, f"fabriclite-relay-to-{address}:{port}")

    def _start(self, sock: socket.socket, peer: str) -> None:
        link = _Link(sock, peer, "connecting", time.monotonic() + self.handshake_s)
        back = socket.socket(socket.AF_INET6 if ":" in self.remote[0] else socket.AF_INET, socket.SOCK_STREAM)
        back.setblocking(False)
        back.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            back.connect(self._resolved())
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            back.close()
            sock.close()
            return
        self._add(link)
        self._attach_back(link, back)

    def _resolved(self) -> Tuple[str, int]:
        host, port = self.remote
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][:2]

    def _handshake(self, link: _Link, side: str, sock: socket.socket) -> None:
        if side == "front":  # a rank spoke before the link opened: held until it is (bounded by _watch)
            data = sock.recv(_CHUNK)
            if not data:
                self._close(link)
                return
            link.held.extend(data)
            return
        want = HELLO_BYTES if link.state == "hello" else MAC_BYTES
        received = self._gather(link, sock, want, want)  # closed: refused (a wrong secret) or gone
        if received is None:
            return
        if link.state == "hello":
            try:
                proof, link.expected = client_proof(self.secret, received)
            except ValueError:
                self._close(link)
                return
            link.to_back.extend(proof)
            link.state = "awaiting"
            return
        if not hmac.compare_digest(received, link.expected):
            self._close(link)
            return
        self._opened(link)
        link.to_back.extend(link.held)  # what the rank said meanwhile, after the proof
        link.held.clear()
