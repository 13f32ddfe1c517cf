"""Which processes are debris? A pure selection (`select_orphans`) over a
process listing (`scan`, the one impure function here).

Debris is: a process of this agent (MESHD_AGENT, its state directory, in the
process's environment: several agents may share a host, and none may touch
another's ranks) carrying the
meshd generation marker (on its command line, in its rank title, or in
MESHD_GENERATION) whose generation is not the current one; a standby rank of
this agent (STANDBY_MARKER on its command line, or its title: it carries no
generation until the rank it becomes titles itself) that the agent does not hold; a
manifest entry of a retired generation that is still alive; an `ibv_devinfo`
/ `ibv_devices` that has run longer than a limit (hung in the RDMA driver).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import psutil

from agents.manifest import ManifestEntry
from common import proctitle

MARKER = re.compile(rf"(?:--meshd-generation[= ]|meshd-generation=|^{proctitle.RANK} gen=)(\d+)")
STANDBY_MARKER = "--meshd-standby"
IBV_TOOLS = ("ibv_devinfo", "ibv_devices")


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    name: str
    cmdline: tuple[str, ...]
    create_time: float
    env_generation: int | None = None
    agent: str | None = None  # MESHD_AGENT of the process, when readable
    standby: bool = False  # a standby rank (runtime/standby.py), or a rank one became that has no title yet


@dataclass(frozen=True)
class Orphan:
    pid: int
    create_time: float
    reason: str
    what: str


def marked_standby(cmdline: tuple[str, ...]) -> bool:
    """A standby by its command line, or by its title once it set it (common/proctitle.py)."""
    return STANDBY_MARKER in cmdline or cmdline[0].split(" ")[0] == proctitle.STANDBY


def marker_generation(p: ProcInfo) -> int | None:
    m = MARKER.search(" ".join(p.cmdline))
    if m:
        return int(m.group(1))
    return p.env_generation


def select_orphans(procs: list[ProcInfo], *, agent: str, current: int | None, keep_pids: set[int],
                   manifest: list[ManifestEntry], now: float, ibv_limit: float) -> list[Orphan]:
    out: dict[int, Orphan] = {}
    alive = {p.pid: p for p in procs}
    for p in procs:
        if p.pid in keep_pids:
            continue
        what = " ".join(p.cmdline)[:200] or p.name
        gen = marker_generation(p)
        if gen is not None and gen != current and p.agent == agent:
            out[p.pid] = Orphan(p.pid, p.create_time, f"generation {gen} is not the current one ({current})", what)
        elif p.standby and p.agent == agent:
            out[p.pid] = Orphan(p.pid, p.create_time, "a standby rank this agent does not hold", what)
        elif any(p.name == t or (p.cmdline and p.cmdline[0].endswith("/" + t)) or
                 (p.cmdline and p.cmdline[0] == t) for t in IBV_TOOLS) and now - p.create_time > ibv_limit:
            out[p.pid] = Orphan(p.pid, p.create_time,
                                f"{p.name} running {now - p.create_time:.0f}s (limit {ibv_limit:.0f}s): hung", what)
    for entry in manifest:
        p = alive.get(entry.pid)
        if (p is not None and p.pid not in keep_pids and p.pid not in out
                and entry.generation != current and abs(p.create_time - entry.create_time) < 1.0):
            out[p.pid] = Orphan(p.pid, p.create_time,
                                f"manifest entry of retired generation {entry.generation}", " ".join(p.cmdline)[:200])
    return sorted(out.values(), key=lambda o: o.pid)


def scan() -> list[ProcInfo]:
    """Processes that could be meshd debris: marked ranks and ibv tools. Only
    those get their environment read."""
    out = []
    me = os.getpid()
    for p in psutil.process_iter(["pid", "name", "cmdline", "create_time"]):
        info = p.info
        if info["pid"] == me or not info["cmdline"]:
            continue
        cmdline = tuple(info["cmdline"])
        joined = " ".join(cmdline)
        ibv = info["name"] in IBV_TOOLS or any(t in joined for t in IBV_TOOLS)
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            env = {}
        raw = env.get("MESHD_GENERATION")
        env_gen = int(raw) if raw and raw.isdigit() else None
        standby = marked_standby(cmdline)
        if not (MARKER.search(joined) or env_gen is not None or ibv or standby):
            continue
        out.append(ProcInfo(info["pid"], info["name"] or "", cmdline, info["create_time"], env_gen,
                            env.get("MESHD_AGENT"), standby))
    return out
