"""systemd's notify protocol, without a dependency: datagrams to
$NOTIFY_SOCKET (a path, or an abstract socket when it starts with '@').
Outside systemd (no NOTIFY_SOCKET) every call is a no-op."""

from __future__ import annotations

import asyncio
import os
import socket


def notify(message: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(message.encode())
    return True


def watchdog_interval() -> float | None:
    """Half of WatchdogSec when systemd asked for pings (and they are for us)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6


async def watchdog_pings(interval: float) -> None:
    """Ping from the event loop: a wedged loop stops the pings and systemd restarts us."""
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
