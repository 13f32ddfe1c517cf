"""The demo as a new user meets it on a fresh clone: `meshctl up` (the demo model built, four agents, the
controller, meshd-proxy and four ranks started) and then one 64-token answer, its ranks spinning as MLX's ring
backend has them (no .venv/ringwait.so: before it shipped, or a machine without a C compiler) and with the ring
wait the agents now preload, in alternating rounds, each round in a fresh $MESHD_HOME with one demo up at a time.

    .venv/bin/python bench/first_answer.py [--rev HEAD | --tree] [--rounds 3] [--tokens 64] [--write]

The commit is cloned from this checkout (--tree: this checkout's working tree instead) and runs with its code
first on PYTHONPATH, on this checkout's .venv
(where scripts/venv built ringwait.so; built here first when missing) or on a bare venv over the same packages
(its prefix holds no ringwait.so). Nothing else is preloaded (LD_PRELOAD cleared), as on a fresh machine."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from benchkit import ROOT, pace, report, say, spread

from agents import ringwait
from kit.demo_answers import endless

PROMPT = "Tell me about meshes."


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def clone(rev: str, into: Path) -> Path:
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(into)], check=True)
    git("checkout", "-q", rev, cwd=into)
    return into


def bare_venv(into: Path) -> Path:
    """A venv over .venv's packages whose prefix holds no ringwait.so: its Python."""
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(into)],
                   check=True)
    (site,) = (Path(p) for p in sys.path if p.startswith(sys.prefix) and p.endswith("site-packages"))
    (own,) = into.glob("lib/python*/site-packages")
    (own / "meshd-bench.pth").write_text(f"import site; site.addsitedir({str(site)!r})\n")
    return into / "bin" / "python"


def meshctl(python: Path, code: Path, home: Path, *args: str) -> tuple[str, float]:
    """`meshctl ARGS` run on `python` from a clone's code on the demo of `home`: its output and how long it took."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MESHD_CONFIG")}
    env.update(MESHD_HOME=str(home), PYTHONPATH=str(code))
    t0 = time.perf_counter()
    r = subprocess.run([str(python), "-m", "meshd.meshctl.cli", *args], cwd=code, env=env, capture_output=True,
                       text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"meshctl {' '.join(args)} ({python}) exited {r.returncode}: {r.stdout}{r.stderr}")
    return r.stdout, time.perf_counter() - t0


def answer(url: str, model: Path, tokens: int) -> dict:
    """One streamed answer of `tokens` tokens: the time to its last token, to its first, and its decode pace."""
    t0 = time.perf_counter()
    r = requests.post(f"{url}/chat/completions", stream=True, timeout=900,
                      json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens, "stream": True,
                            **endless(model)})
    r.raise_for_status()
    times = [time.perf_counter() for line in r.iter_lines(decode_unicode=True)
             if line.startswith("data: ") and '"content"' in line]
    return {"answer_s": times[-1] - t0, "ttft_s": times[0] - t0, **pace(times)}


def preloading(status: dict) -> int:
    """How many of the demo's ranks have the ring wait preloaded."""
    def preloads(pid: int) -> bool:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return any(e.startswith(b"LD_PRELOAD=") and b"ringwait" in e for e in env)
    return sum(preloads(n["rank"]["pid"]) for n in status["nodes"])


def round_of(python: Path, code: Path, home: Path, tokens: int) -> dict:
    up, up_s = meshctl(python, code, home, "up")
    url = re.search(r"OpenAI URL: (\S+)", up)[1]
    got = answer(url, home / "demo" / "model", tokens)
    status = json.loads(meshctl(python, code, home, "status", "--json")[0])
    ranks = {"preloading": preloading(status), "ranks": len(status["nodes"])}
    meshctl(python, code, home, "down")
    return {"up_s": up_s, **got, **ranks, "said": "spin while they wait" in up}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    code_from = ap.add_mutually_exclusive_group()
    code_from.add_argument("--rev", default="HEAD", help="the commit cloned")
    code_from.add_argument("--tree", action="store_true", help="this checkout's working tree, uncommitted work and all")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if ringwait.built() is None and (why := ringwait.build(ringwait.library())) is not None:
        raise SystemExit(f"cannot build the ring wait: {why}")
    work = Path(tempfile.mkdtemp(prefix="meshd-first-answer-"))
    rev = git("rev-parse", "--short", "HEAD" if args.tree else args.rev)
    code = ROOT if args.tree else clone(rev, work / "clone")
    source = f"this checkout's working tree (at {rev})" if args.tree else f"a fresh clone of {rev}"
    ways = {"spinning (no ringwait.so)": bare_venv(work / "bare"), "ring wait preloaded": Path(sys.executable)}
    runs: dict[str, list[dict]] = {name: [] for name in ways}
    for n in range(args.rounds):
        for name in (list(ways) if n % 2 == 0 else list(ways)[::-1]):
            got = round_of(ways[name], code, work / f"home-{len(runs[name])}-{name[:4]}", args.tokens)
            runs[name].append(got)
            say(f"round {n}: {name}: up {got['up_s']:.1f} s, {args.tokens}-token answer {got['answer_s']:.2f} s "
                f"({got['tok_s']:.1f} tok/s), {got['preloading']}/{got['ranks']} ranks preloading, the demo "
                f"{'said' if got['said'] else 'did not say'} they spin")
    speed = {name: statistics.median(r["answer_s"] for r in v) for name, v in runs.items()}
    spin, wait = ways
    lines = ["", f"## The demo's first answer on a fresh clone, spinning and with the ring wait "
             f"(`bench/first_answer.py`, {time.strftime('%Y-%m-%d')})", "",
             f"`meshctl up` on the default demo (4 agents and ranks on 127.0.0.1, the model built in it), then one "
             f"streamed {args.tokens}-token answer through meshd-proxy, then `meshctl down`, from {source}; "
             f"{args.rounds} alternating rounds, a fresh $MESHD_HOME each, one demo up at a time, on this "
             f"machine's {len(os.sched_getaffinity(0))} cores (shared with other work). Spinning: a venv without "
             "ringwait.so, as every demo ran before it shipped and as one runs without a C compiler (the demo then "
             "says how much faster it would be). Median (min-max):", "",
             "| ranks | `meshctl up` s | answer s (to its last token) | first token s | decode tok/s | preloading |",
             "|---|---|---|---|---|---|",
             *(f"| {name} | {spread([r['up_s'] for r in v], '{:.1f}')} | {spread([r['answer_s'] for r in v])} | "
               f"{spread([r['ttft_s'] for r in v])} | {spread([r['tok_s'] for r in v], '{:.1f}')} | "
               f"{v[0]['preloading']}/{v[0]['ranks']} |" for name, v in runs.items()),
             "", f"The answer with the ring wait: **{speed[spin] / speed[wait]:.1f}x** faster (medians); `up` and "
             f"its answer together: {statistics.median(r['up_s'] + r['answer_s'] for r in runs[spin]):.1f} s -> "
             f"{statistics.median(r['up_s'] + r['answer_s'] for r in runs[wait]):.1f} s.",
             "", f"Command: `.venv/bin/python bench/first_answer.py {' '.join(sys.argv[1:])}`"]
    report(lines, args.write)


if __name__ == "__main__":
    main()
