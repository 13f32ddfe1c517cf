"""`meshd-agent`: the node agent's process: its supervisor, its API (agents/api.py) and metrics
(agents/metrics.py), and its entry point. Stopping the agent leaves its ranks running: a restarted agent
adopts them.
"""

from __future__ import annotations

from pathlib import Path

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from agents import api
from agents import config as agent_config
from agents.fencing import Fencing
from agents.metrics import AgentMetrics
from agents.supervisor import Supervisor
from common.buildinfo import register_process_metrics
from common.http import run_daemon, start_sites, until_stopped
from common.tls import server_context

log = structlog.get_logger("meshd.agent")


def make_app(sup: Supervisor, token: str, metrics_token: str | None = None,
             log_file: Path | None = None) -> web.Application:
    registry = CollectorRegistry()
    registry.register(AgentMetrics(sup))
    register_process_metrics(registry, "agent")
    fencing = Fencing(sup.config.state_dir / "controller_epoch")
    return api.routes(sup, fencing, registry, token, metrics_token, log_file)


async def serve(cfg: agent_config.AgentConfig, log_file: Path | None = None) -> None:
    token, metrics_token = cfg.token(), cfg.metrics_token()
    sup = Supervisor(cfg)
    await sup.adopt()
    swept = await sup.sweep()
    sup.prune()
    await sup.apply_wired_limit()
    if sup.wired_limit:
        log.info("wired limit", node=cfg.node, **sup.wired_limit)
    log.info("agent starting", node=cfg.node, adopted=[r.pid for r in sup.live()],
             swept=[k["pid"] for k in swept["killed"]])
    tls = server_context(cfg.tls) if cfg.tls else None
    (runner,) = await start_sites([(make_app(sup, token, metrics_token, log_file), cfg.host, cfg.port, tls)],
                                  shutdown_timeout=1.0)
    log.info("agent listening", node=cfg.node, address=f"{'https' if tls else 'http'}://{cfg.host}:{cfg.port}")
    await until_stopped(f"agent {cfg.node} on {cfg.host}:{cfg.port}")
    log.info("agent stopping; ranks keep running and will be adopted", node=cfg.node)
    await runner.cleanup()
    await sup.standby.close()


def load_checked(path: str) -> agent_config.AgentConfig:
    cfg = agent_config.load(path)
    cfg.token()  # a missing or world-readable token is a config mistake, reported at start
    return cfg


def main() -> None:
    run_daemon("meshd-agent", "meshd node agent", "agent config (TOML)", load_checked, serve, "change 'listen'",
               what=lambda cfg: f"node={cfg.node}")


if __name__ == "__main__":
    main()
