"""What a process is, as ps and top show it: each of meshd's processes titles itself where it learns what
it is (setproctitle rewrites the argv memory that ps and /proc/PID/cmdline read, and the 15 characters of
/proc/PID/comm that top shows). The sweep (agents/orphans.py) knows a rank's generation and a standby by
these titles."""

from __future__ import annotations

import os

import setproctitle

RANK = "meshd-rank"
STANDBY = "meshd-standby"


def set_title(title: str) -> None:
    """Retitle this process. The title fits the space of the command line it replaces: setproctitle would
    otherwise take the environment's memory too, and /proc/PID/environ, where the sweep finds whose agent
    a rank is, would read as the title."""
    os.environ["SPT_NOENV"] = "1"
    setproctitle.setproctitle(title)
    del os.environ["SPT_NOENV"]


def rank(generation: int, index: int, world: int | None, node: str, mesh: str | None = None) -> str:
    """A rank's title; its world is known once it joined the mesh, its node and its mesh when an agent started it
    (`mesh` None: this process's, MESHD_MESH: two meshes on one host look different)."""
    title = f"{RANK} gen={generation} rank={index}"
    if world:
        title += f"/{world}"
    return title + _placed(node, mesh)


def standby(node: str, mesh: str | None = None) -> str:
    return STANDBY + _placed(node, mesh)


def _placed(node: str, mesh: str | None) -> str:
    mesh = os.environ.get("MESHD_MESH", "") if mesh is None else mesh
    return (f" node={node}" if node else "") + (f" mesh={mesh}" if mesh else "")


def daemon(prog: str, what: str, config: str) -> str:
    """A daemon's title: what it serves and the config it runs (which mesh's, on a host of several)."""
    return f"{prog} {what} config={config}"
