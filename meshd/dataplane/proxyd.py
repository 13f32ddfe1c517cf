"""`meshd-proxy`: the OpenAI endpoint as its own process, beside the controller (or the controllers:
with a proxy config it fronts several meshes, proxyconfig.py).

It follows each mesh's fleet through its control API (meshd/dataplane/fleetlink.py), so it keeps
serving while a controller restarts or is away.

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
from meshd.dataplane.fleetlink import RemoteFleet, remembered
from meshd.dataplane.proxyconfig import Front, load_front
from meshd.metrics import ProxyMetrics
from meshd.dataplane.proxy import Proxy
from meshd.seam import Serving

log = structlog.get_logger("meshd.dataplane.proxyd")

HANDED_FD = "MESHD_PROXY_FD"  # the listening socket's descriptor, in a successor
READY_FD = "MESHD_PROXY_READY_FD"  # where a successor writes "ready" once it serves
VIEW_FD = "MESHD_PROXY_VIEW_FD"  # where a successor reads the fleet as its predecessor last knew it
SUCCESSOR_START = 60.0  # seconds a successor has to say it serves; otherwise this process goes on serving
FIRST_VIEW = 5.0  # seconds a successor without a view waits for the controller's before it says it serves
DRAIN_REPORT_EVERY = 5.0  # seconds between the drain's reports of the requests still running


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


def handed_views() -> dict[str, Serving]:
    """Each mesh's fleet as the proxy this one replaces last knew it: a successor serves from it at once,
    even while a controller is away."""
    fd = os.environ.pop(VIEW_FD, None)
    if fd is None:
        return {}
    with os.fdopen(int(fd), "rb") as f:
        data = f.read()
    views = json.loads(data) if data else {}
    if "phase" in views:  # from a proxy of one mesh before proxy configs: its one view
        return {"": Serving.from_wire(views)}
    return {name: Serving.from_wire(view) for name, view in views.items()}


def listening_socket(front: Front) -> tuple[socket.socket, str]:
    sock, source = given_socket()
    if sock is not None:
        return sock, source
    host, port = split_listen("proxy.listen", front.proxy.listen)
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(1024)
    return sock, "bound by itself"


class ProxyDaemon:
    def __init__(self, front: Front, argv: list[str], pidfile: Path | None):
        self.front, self.argv, self.pidfile = front, argv, pidfile
        handed = handed_views()
        self.view = "the proxy it replaces" if handed else \
            ("the controllers' stores" if front.several else "the controller's store")
        self.fleets = {m.name: RemoteFleet(m.cfg, handed.get(m.name) or handed.get("") or remembered(m.cfg))
                       for m in front.meshes}
        self.proxy = Proxy(front, self.fleets, ProxyMetrics(front.name))
        self.sock, self.source = listening_socket(front)
        self.stop = asyncio.Event()
        self.handing_over = False

    async def run(self) -> None:
        follow = [asyncio.create_task(fleet.follow()) for fleet in self.fleets.values()]
        p = self.front.proxy
        limits = ListenerLimits(p.header_timeout, p.body_timeout, p.max_connections or default_max_connections())
        listener = Listener(self.proxy.app(), limits, shutdown_timeout=p.drain_timeout,
                            on_refusal=lambda why: self.proxy.metrics.refused.labels(reason=why).inc())
        self.proxy.metrics.connections.set_function(lambda: len(listener.open))
        await listener.start(sock=self.sock)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.hand_over()))
        loop.add_signal_handler(signal.SIGUSR1, say_tasks)
        if p.open_off_loopback:
            log.warning("the proxy serves off loopback without API keys (proxy.allow_open = true): anyone who "
                        "reaches it may use the mesh", listen=p.listen)
        if self.pidfile is not None:
            me = procs.identify(os.getpid())
            self.pidfile.write_text(f"{me.pid} {me.create_time}\n")
        log.info("meshd-proxy serving", meshes=[m.name for m in self.front.meshes], listen=p.listen,
                 socket=self.source, controllers=[m.cfg.control.url for m in self.front.meshes],
                 first_view=self.view if any(f.told for f in self.fleets.values()) else "none yet")
        # Runs once until_stopped has told systemd (MAINPID too: after a reload the successor is the
        # service's main process), so the predecessor stops only after that.
        told = asyncio.create_task(self._tell_predecessor())
        what = f"mesh {self.front.name}" if not self.front.several else \
            f"meshes {', '.join(m.name for m in self.front.meshes)}"
        await until_stopped(f"{what}: OpenAI endpoint on {p.listen}", self.stop, main_pid=True)
        links = self.proxy.links.values()
        log.info("meshd-proxy draining: no new connections; the requests in flight finish",
                 in_flight=sum(link.admission.running for link in links),
                 waiting=sum(link.admission.depth for link in links), drain_timeout=p.drain_timeout)
        progress = asyncio.create_task(self._drain_progress(listener))
        await listener.cleanup(linger=True)  # stops accepting, then waits for the handlers (drain_timeout at most)
        progress.cancel()
        for task in (*follow, told):
            task.cancel()
        await asyncio.gather(*follow, told, return_exceptions=True)
        log.info("meshd-proxy stopped")

    @staticmethod
    async def _drain_progress(listener: Listener) -> None:
        while True:
            await asyncio.sleep(DRAIN_REPORT_EVERY)
            if running := listener.running():
                log.info("meshd-proxy draining", still_running=len(running),
                         longest=f"{running[0][0]} for {running[0][1]:.0f}s")

    async def _tell_predecessor(self) -> None:
        """A successor says it serves to the proxy it replaces, once every controller (or the predecessor's
        view) has named a generation, or after FIRST_VIEW."""
        ready_fd = os.environ.pop(READY_FD, None)
        if ready_fd is None:
            return
        await asyncio.wait([asyncio.ensure_future(fleet.wait_serving(lambda s, f=fleet: f.told is not None, FIRST_VIEW))
                            for fleet in self.fleets.values()])
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
        views = {name: fleet.told.wire() for name, fleet in self.fleets.items() if fleet.told}
        os.write(view_write, json.dumps(views).encode() if views else b"")
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


def say_tasks() -> None:
    """SIGUSR1: every task of the loop and where it waits, to stderr (what a drain that does not end waits on)."""
    for task in asyncio.all_tasks():
        task.print_stack(limit=6, file=sys.stderr)
    sys.stderr.flush()


def event_loop_factory():
    """uvloop's loop where it is installed (a faster relay), asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def serve(front: Front, log_file: Path | None, pidfile: Path | None) -> None:
    await ProxyDaemon(front, [sys.executable, "-m", "meshd.dataplane.proxyd", *sys.argv[1:]], pidfile).run()


def load_checked(path: str) -> Front:
    front = load_front(path)
    for m in front.meshes:
        if m.cfg.control.tls:
            m.cfg.client_tls()  # ConfigError now when there is no mesh CA to check the controller against
    return front


def main() -> None:
    run_daemon("meshd-proxy", "meshd's OpenAI endpoint (beside the controller)", "mesh.toml or a proxy config",
               load_checked, serve, "change proxy.listen",
               what=lambda front: "meshes=" + ",".join(m.name for m in front.meshes),
               pidfile=True, loop_factory=event_loop_factory())


if __name__ == "__main__":
    main()
