"""Waking dozing ranks when a request arrives.

An idle mesh exchanges at a low pace: between exchanges the other ranks sleep
up to --idle-interval, because the transports busy-poll inside a collective. A
request that reaches rank 0 meanwhile would wait out their doze before the
first exchange takes it. Rank 0 therefore listens on its own mesh address (the
one every rank already reaches for the collectives' setup), each other rank
holds a connection to it and dozes in `select` on it, and rank 0 writes a byte
down every connection when it has work: the dozers go to the exchange at once.

A connection proves itself with a token derived from the generation's rank
secret before it is woken; without a secret the hub answers loopback peers
only. A byte only ends a doze early, so nothing here can change what a rank
computes; a lost connection leaves its rank dozing as before.
"""

from __future__ import annotations

import hmac
import select
import socket
import threading
import time
from collections.abc import Callable

from common.hostfile import rank0_host
from common.secretfile import derive
from common.tomlcheck import loopback

TOKEN_BYTES = 64  # a hex sha256


def wake_token(secret: str, generation: int) -> bytes:
    return derive(secret, f"wake of generation {generation}").encode() if secret else b"0" * TOKEN_BYTES


class WakeHub:
    """Rank 0's end: accepts the other ranks' connections in a thread; `wake` writes to each."""

    def __init__(self, host: str, token: bytes, loopback_only: bool):
        self._token, self._loopback_only = token, loopback_only
        self._sock = socket.create_server((host, 0))
        self.port = self._sock.getsockname()[1]
        self._peers: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="wake-hub", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(conn, addr[0]), daemon=True).start()

    def _admit(self, conn: socket.socket, peer: str) -> None:
        conn.settimeout(5)
        try:
            given = b""
            while len(given) < TOKEN_BYTES and (chunk := conn.recv(TOKEN_BYTES - len(given))):
                given += chunk
        except OSError:
            given = b""
        if not hmac.compare_digest(given, self._token) or (self._loopback_only and not loopback(peer)):
            conn.close()
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setblocking(False)
        with self._lock:
            self._peers.append(conn)

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
