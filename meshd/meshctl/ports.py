"""The one port picker: a run of consecutive free ports on 127.0.0.1, at a
preferred base when it is free (the demo's URLs stay where users expect them),
else at a random base (tests, side by side with a running demo). A port is
handed out once per process: two runs picked before either is bound never
overlap."""

from __future__ import annotations

import random
import socket

_handed_out: set[int] = set()


def is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def run_free(base: int, count: int, taken: set[int] = frozenset()) -> bool:
    """Are base .. base+count-1 all free, and none of them in `taken`?"""
    run = range(base, base + count)
    return not taken.intersection(run) and all(is_free(p) for p in run)


def free_run(count: int = 1, preferred: int | None = None, taken: set[int] = frozenset()) -> int:
    """The first port of `count` consecutive free ports, none of them in `taken`."""
    taken = set(taken) | _handed_out
    rng = random.Random()
    candidates = [preferred] if preferred is not None else []
    candidates += [rng.randrange(20000, 32000 - count) for _ in range(500)]  # below Linux's ephemeral range
    for base in candidates:
        if run_free(base, count, taken):
            _handed_out.update(range(base, base + count))
            return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def free_ports(count: int) -> list[int]:
    """`count` free ports (consecutive, from `free_run`)."""
    base = free_run(count)
    return list(range(base, base + count))
