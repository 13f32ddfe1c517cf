"""mlx hostfiles: validation, and the launch environment of one rank.

A hostfile is the JSON `mlx.distributed_config` writes:
`{"backend": "jaccl", "envs": [...], "hosts": [{"ssh", "ips", "rdma"}, ...]}`.
`launch_env` computes exactly what `mlx.launch` would set for a rank
(mlx/_distributed_utils/launch.py is the reference; a test proves it): the
variables, plus the contents of the files some of them point to. One
exception: a mesh of one host gets no transport at all (mlx.launch's one-host
ring file is empty, which mx.distributed.init cannot parse), and its rank is
mx.distributed's one-rank group on every backend.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

BACKENDS = ("ring", "jaccl", "jaccl-ring", "nccl")
# Any of these in a process's environment means it was launched into a mesh
# (mx.distributed.init must then succeed or fail, never fall back to one rank).
DISTRIBUTED_ENV = ("MLX_HOSTFILE", "MLX_IBV_DEVICES", "MLX_WORLD_SIZE")
# The mx.distributed backend each hostfile backend runs on; the agent passes it in MESHD_BACKEND.
MLX_BACKEND = {"ring": "ring", "jaccl": "jaccl", "jaccl-ring": "jaccl", "nccl": "nccl"}

RING_STARTING_PORT = 32323  # mlx.launch --starting-port default
NCCL_PORT = 12345  # mlx.launch --nccl-port default


def distributed_backend(requested: str) -> str:
    """What a rank passes to mx.distributed.init: `requested`, or for "any" the agent's MESHD_BACKEND."""
    return os.environ.get("MESHD_BACKEND", "any") if requested == "any" else requested


class HostfileError(ValueError):
    """A hostfile that cannot be launched; the message says what and how to fix it."""


@dataclass(frozen=True)
class LaunchEnv:
    env: dict[str, str]
    files: dict[str, str]  # env var -> content of the file it must point to


def validate(hostfile: dict, backend: str | None = None) -> tuple[str, list[dict]]:
    """Return (backend, hosts) or raise HostfileError naming the problem."""
    if not isinstance(hostfile, dict) or not isinstance(hostfile.get("hosts"), list):
        raise HostfileError('hostfile must be an object with a "hosts" list, as mlx.distributed_config writes it')
    hosts = hostfile["hosts"]
    backend = backend or hostfile.get("backend") or "ring"
    if backend not in BACKENDS:
        raise HostfileError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if not hosts:
        raise HostfileError("hostfile has no hosts")
    for i, h in enumerate(hosts):
        if not isinstance(h, dict) or not isinstance(h.get("ssh"), str):
            raise HostfileError(f'hosts[{i}] must be an object with an "ssh" name')
        ips = h.get("ips", [])
        if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
            raise HostfileError(f"hosts[{i}].ips must be a list of addresses")
    envs = hostfile.get("envs", [])
    if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e for e in envs):
        raise HostfileError('hostfile "envs" must be a list of "NAME=value" strings')
    n = len(hosts)
    if n == 1:
        return backend, hosts  # no peer to reach: neither addresses nor RDMA devices are needed
    if backend == "ring":
        missing = [h["ssh"] for h in hosts if not h.get("ips")]
        if missing and n > 1:
            raise HostfileError(f"ring backend needs ips for every host; missing for {', '.join(missing)}")
    elif backend in ("jaccl", "jaccl-ring"):
        if not hosts[0].get("ips"):
            raise HostfileError(f"rank 0 ({hosts[0]['ssh']}) needs an ip reachable from all other ranks")
        for i, h in enumerate(hosts):
            rdma = h.get("rdma", [])
            if not isinstance(rdma, list) or len(rdma) != n:
                raise HostfileError(f"hosts[{i}].rdma must list {n} devices (one per host), "
                                    f"got {len(rdma) if isinstance(rdma, list) else rdma!r}")
            if rdma[i] is not None:
                raise HostfileError(f"hosts[{i}].rdma[{i}] must be null (a host has no RDMA device to itself)")
        ring_only = backend == "jaccl-ring"
        missing_pairs = [
            (hosts[i]["ssh"], hosts[j]["ssh"])
            for i, h in enumerate(hosts)
            for j in (((i - 1) % n, (i + 1) % n) if ring_only else range(n))
            if i != j and h["rdma"][j] is None
        ]
        if missing_pairs:
            pairs = ", ".join(f"{a} to {b}" for a, b in missing_pairs[:3])
            raise HostfileError(f"no RDMA device is listed for {pairs}; re-run meshctl provision")
    elif backend == "nccl" and not hosts[0].get("ips"):
        raise HostfileError(f"rank 0 ({hosts[0]['ssh']}) needs an ip reachable from all other ranks")
    return backend, hosts


def host_of(h: dict) -> str:
    """Which machine a hostfile entry is: its first address (several ranks may share one)."""
    return (h.get("ips") or [h["ssh"]])[0]


def local_index(hosts: list[dict], rank: int) -> int:
    """The rank's place among the ranks on its own machine: its GPU, as `mlx.launch --repeat-hosts`
    gives it (`rank % ranks_per_host`) for a hostfile that lists each machine that many times."""
    return sum(1 for h in hosts[:rank] if host_of(h) == host_of(hosts[rank]))


def launch_env(hostfile: dict, rank: int, backend: str | None = None, *,
               starting_port: int = RING_STARTING_PORT, nccl_port: int = NCCL_PORT) -> LaunchEnv:
    backend, hosts = validate(hostfile, backend)
    if not 0 <= rank < len(hosts):
        raise HostfileError(f"rank {rank} is outside the hostfile's {len(hosts)} hosts")
    env: dict[str, str] = {}
    for e in hostfile.get("envs", []):
        key, value = e.split("=", 1)
        env[key] = value
    files: dict[str, str] = {}
    if len(hosts) == 1:  # a mesh of one: no transport; on NCCL its GPU, as mlx.launch gives it
        if backend == "nccl":
            env["CUDA_VISIBLE_DEVICES"] = "0"
    elif backend == "ring":
        port = starting_port
        ring = []
        for h in hosts:
            node = []
            for ip in h.get("ips", []):
                node.append(f"{ip}:{port}")
                port += 1
            ring.append(node)
        files["MLX_HOSTFILE"] = json.dumps(ring)
    elif backend in ("jaccl", "jaccl-ring"):
        env["MLX_JACCL_COORDINATOR"] = f"{hosts[0]['ips'][0]}:{starting_port}"
        if backend == "jaccl-ring":
            env["MLX_JACCL_RING"] = "1"
        files["MLX_IBV_DEVICES"] = json.dumps([h["rdma"] for h in hosts])
    else:
        env["NCCL_HOST_IP"] = hosts[0]["ips"][0]
        env["NCCL_PORT"] = str(nccl_port)
        env["MLX_WORLD_SIZE"] = str(len(hosts))
        env["CUDA_VISIBLE_DEVICES"] = str(local_index(hosts, rank))
    env["MLX_RANK"] = str(rank)
    return LaunchEnv(env, files)


def rank0_host(env: dict[str, str] = os.environ) -> str | None:
    """Rank 0's address on the mesh, as launch_env gives it to every rank (the ring's hostfile, JACCL's
    coordinator, NCCL's host); None when it gives none (a single rank)."""
    if env.get("NCCL_HOST_IP"):
        return env["NCCL_HOST_IP"]
    if env.get("MLX_JACCL_COORDINATOR"):
        return env["MLX_JACCL_COORDINATOR"].rpartition(":")[0]
    if env.get("MLX_HOSTFILE"):
        try:
            ring = json.loads(Path(env["MLX_HOSTFILE"]).read_text() or "[]")
        except (OSError, ValueError):
            return None
        return ring[0][0].rpartition(":")[0] if ring and ring[0] else None
    return None
