"""The one port picker: a run of consecutive free ports on 127.0.0.1, at a
preferred base when it is free (the demo's URLs stay where users expect them),
else at a random base (tests, side by side with a running demo). A port is
free when a server can bind it as meshd's servers do (SO_REUSEADDR) and no live
socket holds it: the connections a server that just stopped leaves in
TIME_WAIT do not count. A port is handed out once per process: two runs picked
before either is bound never overlap. Processes that pick side by side, each
before the other binds, stay apart by each picking in a span of its own
(MESHD_PORT_SPAN: the test suite gives each of its workers one)."""

from __future__ import annotations

import os
import random
import socket

import psutil

_handed_out: set[int] = set()


def _binds(port: int, reuse: bool = False) -> bool:
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def tcp_sockets() -> list:
    """This machine's TCP sockets (psutil's), or none where the OS shows them to root only (macOS)."""
    try:
        return psutil.net_connections("tcp")
    except psutil.AccessDenied:
        return []


def _live_ports() -> set[int]:
    """Local ports of TCP sockets other than TIME_WAIT ones. Linux lets a bind with SO_REUSEADDR through a
    port that a connection holds (a ring's, whose listener closed once its peer connected), so they are
    looked up; macOS, which may not show them, refuses that bind itself."""
    return {c.laddr.port for c in tcp_sockets() if c.status != psutil.CONN_TIME_WAIT}


def run_free(base: int, count: int, taken: set[int] = frozenset()) -> bool:
    """Are base .. base+count-1 all free, and none of them in `taken`?"""
    run = range(base, base + count)
    if taken.intersection(run):
        return False
    held = [p for p in run if not _binds(p)]  # by a live socket, or only by TIME_WAIT connections
    return not held or (all(_binds(p, reuse=True) for p in held) and not _live_ports().intersection(held))


SPAN = (20000, 32000)  # below Linux's ephemeral range (32768 on)


def span(value: str | None) -> tuple[int, int]:
    """The ports random runs are picked from, as MESHD_PORT_SPAN (`value`) says them: "LOW-HIGH", HIGH not
    among them; unset or empty, 20000-32000."""
    if not value:
        return SPAN
    low, _, high = value.partition("-")
    if not (low.isdigit() and high.isdigit() and 1024 <= int(low) < int(high) <= 65536):
        raise ValueError(f"MESHD_PORT_SPAN={value!r} is no span of ports: give LOW-HIGH with 1024 <= LOW < HIGH "
                         "<= 65536 (e.g. 20000-26000), or unset it")
    return int(low), int(high)


def free_run(count: int = 1, preferred: int | None = None, taken: set[int] = frozenset()) -> int:
    """The first port of `count` consecutive free ports, none of them in `taken`."""
    taken = set(taken) | _handed_out
    rng = random.Random()
    low, high = span(os.environ.get("MESHD_PORT_SPAN"))
    candidates = [preferred] if preferred is not None else []
    candidates += [rng.randrange(low, max(low + 1, high - count)) for _ in range(500)]
    for base in candidates:
        if run_free(base, count, taken):
            _handed_out.update(range(base, base + count))
            return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def free_ports(count: int) -> list[int]:
    """`count` free ports (consecutive, from `free_run`)."""
    base = free_run(count)
    return list(range(base, base + count))
