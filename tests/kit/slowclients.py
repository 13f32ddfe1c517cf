"""Slow clients, for the listeners' limits: connections that trickle their
request a byte at a time, JSON nested deep, and a client asking meanwhile."""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time

import requests

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: mesh\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 500


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def allow_descriptors(n: int) -> None:
    """This process may open `n` descriptors (a flood holds more than a thousand sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))


class Trickle:
    """`n` connections to `port`, each sending `first` at once, then `head` a byte every `every` seconds
    from one thread; when each one was closed (seconds from the start), and what each was answered."""

    def __init__(self, port: int, n: int, head: bytes = HEAD, every: float = 2.0, first: bytes = b""):
        self.head, self.every, self.t0 = head, every, time.monotonic()
        self.closed: list[float] = []
        self.answers: list[bytes] = []
        self.socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
        for s in self.socks:
            s.sendall(first)
            s.setblocking(False)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sent = 0
        while self.socks and not self.stop.is_set():
            for s in list(self.socks):
                try:
                    with contextlib.suppress(BlockingIOError):
                        if answer := s.recv(4096):
                            self.answers.append(answer)
                        raise ConnectionResetError("closed")
                    s.send(self.head[sent % len(self.head):][:1])
                except OSError:
                    self.closed.append(time.monotonic() - self.t0)
                    self.socks.remove(s)
                    s.close()
            sent += 1
            self.stop.wait(self.every)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        for s in self.socks:
            s.close()


class Chat:
    """Chat requests to the proxy one after another in a thread; every status kept."""

    def __init__(self, proxy: str):
        self.proxy, self.statuses, self.done = proxy, [], threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            self.statuses.append(requests.post(f"{self.proxy}/v1/chat/completions", json=CHAT, timeout=120).status_code)
            self.done.wait(0.5)

    def stop(self) -> list[int]:
        self.done.set()
        self.thread.join(150)
        return self.statuses
