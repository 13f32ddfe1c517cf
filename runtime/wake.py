"""Waking dozing ranks when a request arrives.

An idle mesh exchanges at a low pace: between exchanges the other ranks sleep
up to --idle-interval, because the transports busy-poll inside a collective. A
request that reaches rank 0 meanwhile would wait out their doze before the
first exchange takes it. Rank 0 therefore listens on its own mesh address (the
one every rank already reaches for the collectives' setup), each other rank
holds a connection to it and dozes in `select` on it, and rank 0 writes a byte
down every connection when it has work: the dozers go to the exchange at once.

A connection proves itself with a token derived from the generation's rank
secret before it is woken, within PROVE_WITHIN seconds of connecting; without a
secret the hub answers loopback peers only. One thread serves every connection,
and at most MAX_UNPROVEN wait to prove themselves at once (a newcomer takes the
place of the oldest): strangers cost rank 0 no thread and a bounded number of
descriptors. A byte only ends a doze early, so nothing here can change what a
rank computes; a lost connection leaves its rank dozing as before.
"""

from __future__ import annotations

import hmac
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable

from common.hostfile import rank0_host
from common.secretfile import derive
from common.tomlcheck import loopback

TOKEN_BYTES = 64  # a hex sha256
PROVE_WITHIN = 5.0  # seconds a connection has to send its token
MAX_UNPROVEN = 64  # connections still owing their token at once (a mesh has 7 other ranks at most)


def wake_token(secret: str, generation: int) -> bytes:
    return derive(secret, f"wake of generation {generation}").encode() if secret else b"0" * TOKEN_BYTES


class WakeHub:
    """Rank 0's end: one thread accepts the other ranks' connections and reads their tokens; `wake`
    writes to each connection that proved itself."""

    def __init__(self, host: str, token: bytes, loopback_only: bool):
        self._token, self._loopback_only = token, loopback_only
        self._sock = socket.create_server((host, 0))
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._peers: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, name="wake-hub", daemon=True).start()

    def _serve(self) -> None:
        unproven: dict[socket.socket, tuple[float, bytes]] = {}  # connection -> (deadline, token so far)
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select(timeout=1.0):
                    if key.fileobj is self._sock:
                        if not self._accept(unproven, sel):
                            return
                    elif key.fileobj in unproven:  # not dropped since the select
                        self._read_token(key.fileobj, unproven, sel)
                now = time.monotonic()
                for conn in [c for c, (deadline, _) in unproven.items() if deadline < now]:
                    self._drop(conn, unproven, sel)

    def _accept(self, unproven: dict, sel: selectors.BaseSelector) -> bool:
        """Take one connection, in the place of the oldest unproven one when MAX_UNPROVEN wait; False
        once the listening socket is closed."""
        try:
            conn, addr = self._sock.accept()
        except BlockingIOError:
            return True
        except OSError:
            return False
        if self._loopback_only and not loopback(addr[0]):
            conn.close()
            return True
        if len(unproven) >= MAX_UNPROVEN:
            self._drop(min(unproven, key=lambda c: unproven[c][0]), unproven, sel)
        conn.setblocking(False)
        unproven[conn] = (time.monotonic() + PROVE_WITHIN, b"")
        sel.register(conn, selectors.EVENT_READ)
        return True

    def _read_token(self, conn: socket.socket, unproven: dict, sel: selectors.BaseSelector) -> None:
        deadline, given = unproven[conn]
        try:
            chunk = conn.recv(TOKEN_BYTES - len(given))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        given += chunk
        if chunk and len(given) < TOKEN_BYTES:
            unproven[conn] = (deadline, given)
        elif chunk and hmac.compare_digest(given, self._token):
            sel.unregister(conn)
            del unproven[conn]
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._peers.append(conn)
        else:
            self._drop(conn, unproven, sel)

    @staticmethod
    def _drop(conn: socket.socket, unproven: dict, sel: selectors.BaseSelector) -> None:
        sel.unregister(conn)
        del unproven[conn]
        conn.close()

    def wake(self) -> None:
        with self._lock:
            for conn in list(self._peers):
                try:
                    conn.send(b"!")
                except BlockingIOError:
                    pass  # bytes already wait there: it is woken
                except OSError:
                    self._peers.remove(conn)
                    conn.close()


class WakeLine:
    """Another rank's end: dozes on its connection to rank 0's hub (a plain sleep without one)."""

    def __init__(self, host: str, port: int, token: bytes):
        self._sock: socket.socket | None = None
        try:
            sock = socket.create_connection((host, port), timeout=5)
            sock.sendall(token)
            sock.setblocking(False)
            self._sock = sock
        except OSError:
            pass

    def doze(self, seconds: float) -> None:
        if self._sock is None:
            time.sleep(seconds)
            return
        readable, _, _ = select.select([self._sock], [], [], seconds)
        if readable:
            try:
                if not self._sock.recv(4096):  # rank 0 is gone: the next exchange says so
                    self._sock.close()
                    self._sock = None
            except BlockingIOError:
                pass
            except OSError:
                self._sock = None


def rouse(lockstep, secret: str, generation: int, log) -> tuple[Callable[[], None] | None, Callable[[float], None]]:
    """Rank 0's hub or another rank's line, agreed through one exchange (a barrier too): what rank 0 calls
    when work arrives (None elsewhere, or when there is no hub), and how this rank dozes."""
    host = rank0_host() if lockstep.size > 1 else None
    token = wake_token(secret, generation)
    hub = None
    if lockstep.rank == 0 and host and (secret or loopback(host)):
        try:
            hub = WakeHub(host, token, loopback_only=not secret)
        except OSError as e:
            log(f"dozing ranks are not woken by requests (cannot listen on {host}: {e})")
    port = lockstep.share(hub.port if hub else 0)
    if hub:
        log(f"dozing ranks are woken by requests through {host}:{port}")
    if lockstep.rank == 0 or not port:
        return (hub.wake if hub else None), time.sleep
    return None, WakeLine(host, port, token).doze
