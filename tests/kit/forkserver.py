"""A fork server of ranks (tests/kit/ranks.py starts it and asks it for ranks): a process that has imported
meshd-rank's code forks each rank, instead of each paying its imports (a CPU-second and more: mlx-lm,
transformers, aiohttp) again.

It is the product's warm start (runtime/standby.py) turned into a fork server: it imports what a standby
imports, and each rank it forks becomes its rank as a standby's does (`standby.become`: its directory,
environment and log), in a session of its own as `start_new_session` gives a spawned one. It does no device
init before a fork: MLX starts its CPU stream's thread at the first evaluation, and a fork carries over only
the thread that forks; importing mlx, mlx-lm and transformers starts no thread but numpy's OpenBLAS pool,
which OpenBLAS shuts down and restarts across a fork.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
from pathlib import Path

from common import proctitle
from runtime import rank, standby


def serve(path: Path, ready: Path) -> dict | None:
    """Fork a rank for each spec asked on the socket at `path` and report its exit there; in a forked rank,
    its spec. None once this server's stdin ends (the process that started it is gone)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    ready.touch()
    ranks: dict[int, socket.socket] = {}
    while True:
        readable = select.select([listener, sys.stdin], [], [], 0.05)[0]
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return None
        if listener in readable:
            conn, _ = listener.accept()
            spec = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                for held in (listener, conn, *ranks.values()):
                    held.close()
                os.setsid()
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                # `python -m runtime.rank` run in `cwd` has it first on its path; this server has tests/ there
                sys.path[0] = spec["cwd"]
                return spec
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            ranks[pid] = conn
        while ranks:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = ranks.pop(pid)
            conn.sendall(json.dumps({"status": status}).encode() + b"\n")
            conn.close()


def main() -> None:
    # setproctitle finds the command line's memory through the environment as the process started, which a
    # forked rank has replaced (`become`) by the time it titles itself; the standby titles itself first too
    proctitle.set_title("meshd-forkserver")
    spec = serve(Path(sys.argv[1]), Path(sys.argv[2]))
    if spec is not None:
        rank.main(standby.become(spec))


if __name__ == "__main__":
    main()
