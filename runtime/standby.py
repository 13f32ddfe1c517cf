"""`meshd-standby`: a rank process that has done its imports and device init, waiting for a spec.

The agent starts it with a pipe on stdin and hands it the next generation's rank as one JSON line
(`argv`, `env`, `cwd`, `log`); it then becomes that rank (`runtime.rank.main`) in the same process.
Once ready it writes its report (`--report`): its pid, the package directories its code comes from
(the agent finds it stale once anything there changed after it started) and the memory it holds.
It loads no model. The end of its stdin (its agent gone) ends it before it takes a spec.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from importlib import metadata
from pathlib import Path

import mlx.core as mx

from common import proctitle
from common.secretfile import open_appending
from common.statusfile import write_atomic
from runtime import rank

# The code a rank runs, by package; the large ones by their installed metadata, not file by file.
PACKAGES = ("runtime", "common", "mlx", "mlx_lm")
DISTRIBUTIONS = ("transformers",)


def code_roots() -> list[str]:
    roots = [p for name in PACKAGES for p in importlib.util.find_spec(name).submodule_search_locations]
    for dist in DISTRIBUTIONS:
        try:
            roots.append(str(metadata.distribution(dist)._path))
        except metadata.PackageNotFoundError:
            pass
    return roots


def become(spec: dict) -> list[str]:
    """Turn this process into the rank `spec` describes: its directory, environment and log; returns its
    arguments."""
    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(spec["env"])
    with open_appending(Path(spec["log"])) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    return spec["argv"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="meshd-standby", description=__doc__.splitlines()[0])
    p.add_argument("--report", required=True, help="where to write this standby's report (JSON)")
    p.add_argument("--meshd-standby", action="store_true", help="the marker the agent's sweep finds standbys by")
    args = p.parse_args(argv)
    proctitle.set_title(proctitle.standby(os.environ.get("MESHD_NODE", "")))
    mx.eval(mx.zeros(1) + 1)  # the device's first use: its context, allocator and first kernel
    write_atomic(Path(args.report), {"pid": os.getpid(), "roots": code_roots(),
                                     "mlx_active_bytes": mx.get_active_memory()})
    print(f"meshd-standby {os.getpid()}: ready", flush=True)
    line = sys.stdin.readline()
    if not line:
        return  # the agent is gone
    rank.main(become(json.loads(line)))


if __name__ == "__main__":
    main()
