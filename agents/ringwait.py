"""MLX's ring ranks, on a host that runs several of them, wait for their peers without spinning.

MLX's ring backend gives each socket a thread that calls recv() on a non-blocking socket in a loop for as long
as a transfer is pending (ring.cpp: no poll, no option): a waiting rank burns a core. Where a host runs more ranks
than it has cores to spare (the demo's four ranks on one machine), the ranks with work wait for the spinning ones'
time slices. ringwait.c, preloaded into such ranks, has recv() wait up to 1 ms in poll() before it answers EAGAIN
(no result changes): a 4-rank demo on 2 cores decodes about 30 times faster (bench/ringwait.py,
docs/BENCHMARKS.md). It is built into the venv at setup (`scripts/venv`, or `python -m agents.ringwait`) where a C
compiler exists; the agent preloads it into Linux ring ranks that share their host with another rank (`preload`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from common.hostfile import host_of

SOURCE = Path(__file__).with_name("ringwait.c")
SPEEDUP = "about 30 times faster"  # a 4-rank demo on 2 cores (bench/ringwait.py, docs/BENCHMARKS.md)


def library(prefix: str = sys.prefix) -> Path:
    """Where setup builds it: beside the venv's Python (the agent's and its ranks')."""
    return Path(prefix) / "ringwait.so"


def built(platform: str = sys.platform) -> Path | None:
    """The library, when this is Linux and it was built."""
    return library() if platform == "linux" and library().is_file() else None


def shares_host(hostfile: dict, rank: int) -> bool:
    """Does another rank of this ring mesh run on `rank`'s host?"""
    hosts = hostfile["hosts"]
    return (hostfile.get("backend", "ring") == "ring"
            and sum(host_of(h) == host_of(hosts[rank]) for h in hosts) > 1)


def preload(hostfile: dict, rank: int, preloaded: str | None, lib: Path | None) -> str | None:
    """The rank's LD_PRELOAD with the library in front, when its ring shares its host with another rank and the
    library is built (`lib`); None: the rank's environment stays as it is (it already preloads one: the test
    runs preload theirs into every process)."""
    if lib is None or not shares_host(hostfile, rank) or lib.name in (Path(p).name for p in
                                                                       (preloaded or "").split(":")):
        return None
    return ":".join(filter(None, [str(lib), preloaded]))


def build(out: Path) -> str | None:
    """Compile ringwait.c into `out`; None when done, else why not (no C compiler, or what it said)."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(SOURCE), "-ldl"], capture_output=True,
                          text=True)
    return None if done.returncode == 0 else f"{cc} failed: {done.stderr.strip()[-400:]}"


def unbuilt(platform: str = sys.platform) -> str | None:
    """Why ring ranks that share this host spin, with how much faster they would run and the fix; None when
    they do not (the library is built, or this is not Linux)."""
    if platform != "linux" or built(platform) is not None:
        return None
    return (f"its ranks spin while they wait for each other (MLX's ring backend polls its sockets; "
            f"{library()} is not built): with it they decode {SPEEDUP} on a small machine. Build it with a C "
            f"compiler (Debian: `sudo apt-get install gcc`): `{sys.executable} -m agents.ringwait` (scripts/venv "
            "runs it), then `meshctl down` and `meshctl up`")


def main() -> None:
    if sys.platform != "linux":
        print("ringwait: only Linux ranks spin (nothing to build here)")
        return
    why = build(library())
    print(f"ringwait: built {library()}" if why is None else
          f"ringwait: not built ({why}); ring ranks that share a host spin while they wait")


if __name__ == "__main__":
    main()
