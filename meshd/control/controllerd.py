"""`meshd`: the controller daemon. Runs the reconciler and the control API (meshd/control/api.py, over
`ControllerView`; loopback by default; bearer token from a 0600 file in the state directory).
The OpenAI endpoint is meshd-proxy's (meshd/dataplane/proxyd.py), which follows the fleet
through this API. Stopping the controller leaves the mesh serving, and the
proxy with it: a restarted controller adopts the running generation.
One controller per mesh: it holds the state directory's lock before it acts
on anything, and stops when a newer one has taken the mesh over."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sqlite3
import ssl
import time
from pathlib import Path
from typing import Callable

import structlog
from aiohttp import web

from common.http import run_daemon, start_sites, until_stopped
from common.secretfile import ensure_secret
from common.tls import Pair, ensure_ca, ensure_issued, local_names, server_context
from common.tomlcheck import ConfigError, listen_host, split_listen
from meshd import configdiff
from meshd.config import MeshConfig, load
from meshd.control import api, survey
from meshd.control.audit import Row
from meshd.control.controller import Controller
from meshd.control.epochround import EpochRefused
from meshd.metrics import Metrics
from meshd.seam import Observation, Serving
from meshd.store import Store

log = structlog.get_logger("meshd")


def control_token(state_dir: Path) -> str:
    """The control API token, created 0600 on first start."""
    return ensure_secret(state_dir / "control.token")


def control_tls(cfg: MeshConfig) -> ssl.SSLContext | None:
    """Off loopback the control API speaks TLS with a certificate from the mesh CA (both made on first use)."""
    if not cfg.control.tls:
        return None
    ca = ensure_ca(cfg.tls_dir, cfg.name)
    pair = Pair(cfg.tls_dir / "control.pem", cfg.tls_dir / "control.key")
    return server_context(ensure_issued(ca, pair, f"meshd control of mesh {cfg.name}",
                                        local_names(listen_host(cfg.control.listen))))


def urls(cfg: MeshConfig) -> dict:
    return {"proxy": f"http://{cfg.proxy.listen}/v1", "control": cfg.control.url,
            "metrics": f"{cfg.control.url}/metrics", "proxy_metrics": f"{cfg.proxy.url}/metrics",
            "agents": {n.name: {"api": n.agent, "metrics": f"{n.agent}/metrics"} for n in cfg.nodes}}


class ControllerView:
    """The control API's and the page's view of the controller (api.ControlView): what their routes read
    of it and ask of it, and nothing more."""

    def __init__(self, ctl: Controller):
        self._ctl = ctl
        self.mesh, self.tls, self.proxy_url = ctl.cfg.name, ctl.cfg.control.tls, ctl.cfg.proxy.url
        self.nodes = tuple(n.name for n in ctl.cfg.nodes)

    @property
    def session(self):
        return self._ctl.session

    def now(self) -> dict:
        return {"phase": self._ctl.state.phase, "generation": self._ctl.state.generation}

    def problems(self) -> list[str]:
        """What is wrong with this controller's ground: its store failing, a newer controller."""
        store, cfg = self._ctl.store, self._ctl.cfg
        fence = store.fence
        problems = []
        if store.failing:
            since = time.strftime("%H:%M:%S", time.localtime(store.failing_since))
            problems.append(f"the store ({cfg.store_path}) fails to write since {since}: {store.failing}; "
                            f"{len(store.pending)} writes wait (free space in {cfg.state_dir})")
        if fence and fence.newer is not None:
            problems.append(f"controller {fence.newer} has taken this mesh over; this one ({fence.ballot}) acts on "
                            "nothing more")
        return problems

    async def status(self) -> dict:
        ctl = self._ctl
        return {**await survey.status(ctl.cfg, ctl.state, ctl.agents, ctl.store), "urls": urls(ctl.cfg),
                "agent_errors": ctl.agent_errors,
                "config": configdiff.view(ctl.cfg, ctl.store.get(configdiff.KEY, {}), ctl.state.generation)}

    def config(self) -> MeshConfig:
        return self._ctl.cfg

    async def apply(self, cfg: MeshConfig) -> None:
        await self._ctl.apply(cfg)

    def incidents(self, n: int) -> list[dict]:
        return self._ctl.store.incidents(n)

    def history(self) -> dict:
        store = self._ctl.store
        return {"incidents": store.incidents(200), "generations": store.generations(50), "audit": store.audit(200)}

    def record(self, row: Row) -> None:
        self._ctl.store.record_audit(row.user, row.remote, row.action, row.outcome)

    def beat(self) -> None:
        self._ctl.store.put("controller", {"pid": os.getpid(), "at": time.time()})

    def serving(self) -> Serving:
        return self._ctl.serving()

    async def wait_serving(self, predicate: Callable[[Serving], bool], timeout: float) -> Serving:
        return await self._ctl.wait_serving(predicate, timeout)

    async def report(self, observation: Observation) -> None:
        await self._ctl.report(observation)

    async def up(self) -> None:
        await self._ctl.up()

    async def down(self, force: bool) -> None:
        await self._ctl.down(force)

    async def restart(self) -> None:
        await self._ctl.restart()

    async def node_log(self, node: str, rank_log: bool, generation: int, lines: int, after: int | None) -> dict:
        agent = self._ctl.agents[node]
        if rank_log:
            return await agent.rank_log(generation, self.nodes.index(node), lines, after)
        return await agent.agent_log(lines, after)


def control_app(ctl: Controller, metrics: Metrics, token: str, log_file: Path | None = None) -> web.Application:
    return api.routes(ControllerView(ctl), metrics.registry, token, log_file)


def hold_lock(cfg: MeshConfig) -> int:
    """The state directory's lock (its fd), held for as long as this process lives: one controller per mesh.
    SystemExit naming the holder when another controller holds it: this one has done nothing."""
    path = cfg.state_dir / "controller.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise SystemExit(f"meshd: another controller of mesh {cfg.name} (pid {holder}) holds {path}; this one "
                         f"did nothing. One controller runs a mesh: if pid {holder} is stopped (kill -STOP, a "
                         f"debugger), resume it (kill -CONT {holder}); to replace it, stop it first (kill {holder}: "
                         "the mesh keeps serving and the next controller adopts it)")
    with contextlib.suppress(OSError):  # the pid only names the holder; a full disk must not stop a controller
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


async def check_listen(listen: str) -> None:
    """OSError now when another process listens on `listen`: the API binds only after adoption, and a
    controller that cannot serve must not act first."""
    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, *split_listen("control.listen", listen),
                                                            reuse_address=True)
    server.close()
    await server.wait_closed()


async def serve(cfg: MeshConfig, log_file: Path | None = None) -> None:
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    lock = hold_lock(cfg)
    await check_listen(cfg.control.listen)
    token = control_token(cfg.state_dir)
    metrics = Metrics(cfg.name)
    try:
        store = Store(cfg.store_path, on_error=lambda message: metrics.store_errors.inc())
    except sqlite3.Error as e:
        raise SystemExit(f"meshd: cannot open the store {cfg.store_path} ({e}); free space in {cfg.state_dir} or "
                         "check its permissions, then start meshd again (the mesh keeps serving meanwhile)")
    metrics.store_pending.set_function(lambda: len(store.pending))
    ctl = Controller(cfg, store, metrics)
    try:
        await ctl.start()  # the epoch, then adoption: no command may arrive before the controller knows what runs
    except EpochRefused as e:
        await ctl.close()
        store.close()
        os.close(lock)
        raise SystemExit(f"meshd: mesh {cfg.name}: {e}")
    fence = store.fence
    runners = await start_sites([(control_app(ctl, metrics, token, log_file),
                                  *split_listen("control.listen", cfg.control.listen), control_tls(cfg))])
    log.info("meshd running", mesh=cfg.name, control=cfg.control.listen, epoch=str(fence.ballot),
             phase=ctl.state.phase, generation=ctl.state.generation)
    # Until a signal, or a newer controller (fence.newer says which: a signal sets the event too).
    await until_stopped(f"mesh {cfg.name}: control API on {cfg.control.listen}", stop=fence.superseded)
    log.info("meshd stopping; the mesh keeps serving and will be adopted", generation=ctl.state.generation)
    for r in runners:  # the API's loops first: they use the controller's session
        await r.cleanup()
    await ctl.close()
    store.close()
    os.close(lock)
    if fence.newer is not None:
        raise SystemExit(f"meshd: controller {fence.newer} has taken mesh {cfg.name} over ({fence.by} said so); "
                         f"this one ({fence.ballot}) stopped and acted on nothing after it. Two controllers for "
                         "these nodes (two state directories) take the mesh from each other as each starts: keep "
                         "one")


def load_checked(path: str) -> MeshConfig:
    cfg = load(path)
    for n in cfg.nodes:
        if not n.token_file.exists():
            raise ConfigError(f"nodes.{n.name}.token_file: {n.token_file} does not exist; copy the token "
                              "from that node's agent (its token_file)")
    if cfg.agents_over_tls:
        cfg.client_tls()  # ConfigError now when there is no mesh CA to check the agents against
    return cfg


def main() -> None:
    run_daemon("meshd", "meshd controller", "mesh.toml", load_checked, serve, "change control.listen",
               what=lambda cfg: f"mesh={cfg.name}")


if __name__ == "__main__":
    main()
