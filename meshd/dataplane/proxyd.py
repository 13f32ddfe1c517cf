"""`meshd-proxy`: the OpenAI endpoint as its own process, beside the controller.

It follows the fleet through the control API (meshd/dataplane/fleetlink.py), so it keeps
serving while the controller restarts or is away.

Its listening socket, in order of preference: one handed over by the proxy it
replaces, systemd's (socket activation: LISTEN_FDS), launchd's (the plist's
`Sockets`, key Listeners), else it binds proxy.listen itself.

SIGHUP hands the socket over: a successor starts with it, says when it serves,
and this process stops accepting, lets the requests in flight finish (up to
proxy.drain_timeout) and exits. No connection is refused: the socket never
closes. SIGTERM drains the same way without a successor.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import structlog

from common import procs
from common.http import Listener, ListenerLimits, default_max_connections, run_daemon, until_stopped
from common.tomlcheck import split_listen
from meshd.config import MeshConfig, load
from meshd.dataplane.fleetlink import RemoteFleet, remembered
from meshd.metrics import ProxyMetrics
from meshd.dataplane.proxy import Proxy
from meshd.seam import Serving

log = structlog.get_logger("meshd.dataplane.proxyd")

HANDED_FD = "MESHD_PROXY_FD"  # the listening socket's descriptor, in a successor
READY_FD = "MESHD_PROXY_READY_FD"  # where a successor writes "ready" once it serves
VIEW_FD = "MESHD_PROXY_VIEW_FD"  # where a successor reads the fleet as its predecessor last knew it
SUCCESSOR_START = 60.0  # seconds a successor has to say it serves; otherwise this process goes on serving
FIRST_VIEW = 5.0  # seconds a successor without a view waits for the controller's before it says it serves


def launchd_socket(name: str) -> socket.socket | None:
    """The socket launchd holds for the plist's Sockets entry `name` (macOS only)."""
    if sys.platform != "darwin":
        return None
    libc = ctypes.CDLL(None)
    fds, count = ctypes.POINTER(ctypes.c_int)(), ctypes.c_size_t()
    if libc.launch_activate_socket(name.encode(), ctypes.byref(fds), ctypes.byref(count)) or not count.value:
        return None  # not started by launchd, or no such socket
    sock = socket.socket(fileno=fds[0])
    libc.free(fds)
    return sock


def given_socket() -> tuple[socket.socket | None, str]:
    """The listening socket this process was started with, and who gave it."""
    if (fd := os.environ.pop(HANDED_FD, None)) is not None:
        return socket.socket(fileno=int(fd)), "the proxy it replaces"
    if os.environ.get("LISTEN_PID") == str(os.getpid()) and os.environ.get("LISTEN_FDS") == "1":
        for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(k, None)
        return socket.socket(fileno=3), "systemd (socket activation)"
    if (sock := launchd_socket("Listeners")) is not None:
        return sock, "launchd (the plist's Sockets)"
    return None, ""


def handed_view() -> Serving | None:
    """The fleet as the proxy this one replaces last knew it: a successor serves from it at once, even
    while the controller is away."""
    fd = os.environ.pop(VIEW_FD, None)
    if fd is None:
        return None
    with os.fdopen(int(fd), "rb") as f:
        data = f.read()
    return Serving.from_wire(json.loads(data)) if data else None


def listening_socket(cfg: MeshConfig) -> tuple[socket.socket, str]:
    sock, source = given_socket()
    if sock is not None:
        return sock, source
    host, port = split_listen("proxy.listen", cfg.proxy.listen)
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(1024)
    return sock, "bound by itself"


class ProxyDaemon:
    def __init__(self, cfg: MeshConfig, argv: list[str], pidfile: Path | None):
        self.cfg, self.argv, self.pidfile = cfg, argv, pidfile
        handed = handed_view()
        self.view = "the proxy it replaces" if handed else "the controller's store"
        self.fleet = RemoteFleet(cfg, handed or remembered(cfg))
        self.proxy = Proxy(cfg, self.fleet, ProxyMetrics(cfg.name))
        self.sock, self.source = listening_socket(cfg)
        self.stop = asyncio.Event()
        self.handing_over = False

    async def run(self) -> None:
        follow = asyncio.create_task(self.fleet.follow())
        p = self.cfg.proxy
        limits = ListenerLimits(p.header_timeout, p.body_timeout, p.max_connections or default_max_connections())
        listener = Listener(self.proxy.app(), limits, shutdown_timeout=p.drain_timeout,
                            on_refusal=lambda why: self.proxy.metrics.refused.labels(reason=why).inc())
        self.proxy.metrics.connections.set_function(lambda: len(listener.open))
        await listener.start(sock=self.sock)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.hand_over()))
        if self.cfg.proxy.open_off_loopback:
            log.warning("the proxy serves off loopback without API keys (proxy.allow_open = true): anyone who "
                        "reaches it may use the mesh", listen=self.cfg.proxy.listen)
        if self.pidfile is not None:
            me = procs.identify(os.getpid())
            self.pidfile.write_text(f"{me.pid} {me.create_time}\n")
        log.info("meshd-proxy serving", mesh=self.cfg.name, listen=self.cfg.proxy.listen, socket=self.source,
                 controller=self.cfg.control.url, first_view=self.view if self.fleet.told else "none yet")
        # Runs once until_stopped has told systemd (MAINPID too: after a reload the successor is the
        # service's main process), so the predecessor stops only after that.
        told = asyncio.create_task(self._tell_predecessor())
        await until_stopped(f"mesh {self.cfg.name}: OpenAI endpoint on {self.cfg.proxy.listen}", self.stop,
                            main_pid=True)
        log.info("meshd-proxy draining: no new connections; the requests in flight finish",
                 in_flight=self.proxy.admission.running, waiting=self.proxy.admission.depth,
                 drain_timeout=self.cfg.proxy.drain_timeout)
        await listener.cleanup()  # stops accepting, then waits for the handlers (drain_timeout at most)
        for task in (follow, told):
            task.cancel()
        await asyncio.gather(follow, told, return_exceptions=True)
        log.info("meshd-proxy stopped")

    async def _tell_predecessor(self) -> None:
        """A successor says it serves to the proxy it replaces, once the controller (or the predecessor's
        view) has named a generation, or after FIRST_VIEW."""
        ready_fd = os.environ.pop(READY_FD, None)
        if ready_fd is None:
            return
        await self.fleet.wait_serving(lambda s: self.fleet.told is not None, FIRST_VIEW)
        with contextlib.suppress(OSError):
            os.write(int(ready_fd), b"ready\n")
        os.close(int(ready_fd))

    async def hand_over(self) -> None:
        """Start a successor with our listening socket; once it serves, drain and exit."""
        if self.handing_over or self.stop.is_set():
            return
        self.handing_over = True
        read, write = os.pipe()
        view_read, view_write = os.pipe()  # a pipe's buffer holds the view: written before the successor runs
        os.write(view_write, json.dumps(self.fleet.told.wire()).encode() if self.fleet.told else b"")
        os.close(view_write)
        env = {**os.environ, HANDED_FD: str(self.sock.fileno()), READY_FD: str(write), VIEW_FD: str(view_read)}
        env.pop("WATCHDOG_PID", None)  # the successor pings systemd's watchdog as the new main process
        log.info("handing the listening socket to a successor")
        child = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                 pass_fds=(self.sock.fileno(), write, view_read))
        os.close(write)
        os.close(view_read)
        reading = asyncio.get_running_loop().run_in_executor(None, os.read, read, 16)
        try:
            said = await asyncio.wait_for(asyncio.shield(reading), SUCCESSOR_START)
        except asyncio.TimeoutError:
            child.kill()
            said = await reading  # end of file, once the successor is gone
        os.close(read)
        self.handing_over = False
        if said.strip() != b"ready":
            log.error("the successor did not start; this proxy goes on serving", pid=child.pid,
                      exit_code=child.poll())
            return
        log.info("the successor serves; draining this proxy", successor=child.pid)
        os.environ.pop("NOTIFY_SOCKET", None)  # systemd hears the successor now: a STOPPING=1 would stop it
        self.stop.set()


def event_loop_factory():
    """uvloop's loop where it is installed (a faster relay), asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def serve(cfg: MeshConfig, log_file: Path | None, pidfile: Path | None) -> None:
    await ProxyDaemon(cfg, [sys.executable, "-m", "meshd.dataplane.proxyd", *sys.argv[1:]], pidfile).run()


def load_checked(path: str) -> MeshConfig:
    cfg = load(path)
    if cfg.control.tls:
        cfg.client_tls()  # ConfigError now when there is no mesh CA to check the controller against
    return cfg


def main() -> None:
    run_daemon("meshd-proxy", "meshd's OpenAI endpoint (beside the controller)", "mesh.toml", load_checked, serve,
               "change proxy.listen", pidfile=True, loop_factory=event_loop_factory())


if __name__ == "__main__":
    main()
