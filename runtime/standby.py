"""`meshd-standby`: a rank process that has done its imports and device init, waiting for a spec.

The agent starts it with a pipe on stdin and hands it the next generation's rank as one JSON line
(`argv`, `env`, `cwd`, `log`); it then becomes that rank (`runtime.rank.main`) in the same process.
Before that the agent asks whether it is there (`{"ask": ...}`), which it answers in a file
(`--answer`): a stopped or hung standby does not, and is never handed a rank.
Once ready it writes its report (`--report`): its pid, the identity of every file its code came from
(each module it imported, and the metadata directory of each distribution they belong to: the agent
finds it stale once any of them changed) and the memory it holds.
It loads no model. The end of its stdin (its agent gone) ends it before it takes a spec.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from pathlib import Path

import mlx.core as mx

from common import proctitle
from common.buildinfo import identities
from common.secretfile import open_appending
from common.statusfile import write_atomic
from runtime import rank


def imported_code() -> list[str]:
    """The files of every module this process imported, and the metadata directories (dist-info) of the
    distributions they come from, which an upgrade renames or replaces."""
    modules = list(sys.modules.items())
    paths = {os.path.abspath(m.__file__) for _, m in modules if isinstance(getattr(m, "__file__", None), str)}
    owners = metadata.packages_distributions()
    for dist in {d for name, _ in modules for d in owners.get(name.partition(".")[0], ())}:
        try:
            found = getattr(metadata.distribution(dist), "_path", None)
        except metadata.PackageNotFoundError:
            continue
        if found is not None:
            paths.add(os.path.abspath(found))
    return sorted(paths)


def wait_for_spec(answer: Path) -> dict | None:
    """The spec the agent hands this standby, after answering each of its questions in `answer`; None when
    its pipe ends (the agent is gone)."""
    for line in iter(sys.stdin.readline, ""):
        message = json.loads(line)
        if "ask" not in message:
            return message
        write_atomic(answer, {"answered": message["ask"]})
    return None


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
    p.add_argument("--answer", required=True, help="where to answer the agent's questions (JSON)")
    p.add_argument("--meshd-standby", action="store_true", help="the marker the agent's sweep finds standbys by")
    args = p.parse_args(argv)
    proctitle.set_title(proctitle.standby(os.environ.get("MESHD_NODE", "")))
    mx.eval(mx.zeros(1) + 1)  # the device's first use: its context, allocator and first kernel
    write_atomic(Path(args.report), {"pid": os.getpid(), "code": identities(imported_code()),
                                     "mlx_active_bytes": mx.get_active_memory()})
    print(f"meshd-standby {os.getpid()}: ready", flush=True)
    spec = wait_for_spec(Path(args.answer))
    if spec is not None:
        rank.main(become(spec))


if __name__ == "__main__":
    main()
