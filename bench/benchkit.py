"""What the benchmarks share: driving the demo mesh through meshctl, the
Llama-shaped random model of the GPU runs, a decode's pace, and appending a
result table to docs/BENCHMARKS.md."""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def say(msg: str) -> None:
    """A progress line, stamped with the benchmark's name and the time."""
    print(f"[{Path(sys.argv[0]).stem} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def add_gpu_run_args(ap: argparse.ArgumentParser) -> None:
    """What a GPU benchmark run takes: where to write, the backend, answer length and a Llama shape of
    random bf16 weights (the defaults are 8B's, 16 GB)."""
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--backend", default="nccl", help="ring: the same run on CPUs, to try the script out")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)


def build_llama_shape(args: argparse.Namespace, path: Path) -> Path:
    from runtime.models.demo_model import DemoModelSpec, build_demo_model

    return build_demo_model(path, DemoModelSpec(
        hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.intermediate,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, model_vocab=args.vocab,
        max_position_embeddings=8192, dtype="bfloat16", seed=1))


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """A figure over rounds as the tables give it: median (min-max)."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def pace(times: list[float]) -> dict:
    """A decode's pace from its tokens' arrival times: tok/s over the whole answer, and the median gap
    between tokens, which a few stalls in a round do not move."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"tokens": len(times), "tok_s": len(gaps) / (times[-1] - times[0]),
            "step_ms_median": 1000 * statistics.median(gaps)}


def meshctl(home: Path, *args: str, check: bool = True) -> str:
    """Run meshctl against the demo mesh living in `home` ($MESHD_HOME)."""
    env = {**os.environ, "MESHD_HOME": str(home)}
    env.pop("MESHD_CONFIG", None)
    r = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", *args], env=env, capture_output=True, text=True,
                       timeout=600)
    if check and r.returncode != 0:
        raise SystemExit(f"meshctl {' '.join(args)} failed: {r.stdout}{r.stderr}")
    return r.stdout


def meshctl_for(mesh: Path, *args: str, check: bool = True) -> str:
    """Run meshctl against the mesh described by `mesh` (a mesh.toml)."""
    return meshctl(mesh.parent, "--config", str(mesh), *args, check=check)


def alternate(meshes: dict, rounds: int, ask) -> tuple[list[dict], dict[str, list[str]], dict, dict]:
    """`rounds` alternating rounds of `ask(url, n)` -> a pace with its "text", each mesh asked in turn while
    the others idle, after a round 0 that warms every mesh up and is not counted: the rounds' paces by mesh,
    each mesh's texts (round 0 first), its tok/s by round and their median. It returns after the status
    files' next heartbeat."""
    rows, texts = [], {name: [] for name in meshes}
    for n in range(rounds + 1):
        order = list(meshes) if n % 2 else list(meshes)[::-1]
        row = {name: ask(meshes[name].url, n) for name in order}
        for name in order:
            texts[name].append(row[name].pop("text"))
        print(f"round {n}: " + ", ".join(f"{k} {v['tok_s']:.2f} tok/s" for k, v in row.items()), file=sys.stderr)
        if n:
            rows.append(row)
    time.sleep(1.5)
    rate = {name: [r[name]["tok_s"] for r in rows] for name in meshes}
    return rows, texts, rate, {name: statistics.median(v) for name, v in rate.items()}


def _loaded(base: Path, path: str):
    spec = importlib.util.spec_from_file_location(f"base_{Path(path).stem}", base / path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def base_module(base: Path, path: str, *beside: str):
    """The module at `path` in another checkout `base` (e.g. a git worktree of an older commit), loaded beside
    this tree's, and the name of that checkout: its commit, or its folder's name where git cannot say. What it
    imports from the modules at `beside` (paths in `base` too, each loaded in this order, importing the ones before
    it the same way) is theirs in `base`, not this tree's: each stands in this tree's place while they load."""
    names = [other.removesuffix(".py").replace("/", ".") for other in beside]
    ours = {name: sys.modules.get(name) for name in names}
    try:
        for other, name in zip(beside, names):
            sys.modules[name] = _loaded(base, other)
        module = _loaded(base, path)
    finally:
        for name, mine in ours.items():
            if mine is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mine
    try:
        top, commit = subprocess.run(["git", "-C", str(base), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.split() or ("", "")
    except OSError:  # no git on this machine
        top, commit = "", ""
    # else a copy of the file, its folder named for its commit (inside another checkout, whose HEAD it is not)
    return module, commit if top and Path(top).resolve() == base.resolve() else base.name


def batch_engine_at(base: Path):
    """runtime/engine/batch.py of a checkout that still has the batch engine (0b5531f and before; or a folder
    holding that commit's runtime/engine/{batch,request,sampling,scheduler}.py), with its own sampling, scheduler
    and request modules; and the checkout's name (`base_module`)."""
    return base_module(base, "runtime/engine/batch.py",
                       *(f"runtime/engine/{name}.py" for name in ("sampling", "scheduler", "request")))


def report(lines: list[str], write: bool) -> None:
    """Print the result table; with `write`, append it to docs/BENCHMARKS.md."""
    table = "\n".join(lines)
    print(table)
    if not write:
        return
    docs = ROOT / "docs" / "BENCHMARKS.md"
    if not docs.exists():
        docs.write_text("# Benchmarks\n\nEvery figure here was measured by the command under it.\n\n")
    with docs.open("a") as f:
        f.write(table + "\n")


def standin_model(directory: Path) -> Path:
    """What a stand-in rank "serves": a model directory that passes the controller's start checks
    (a config and a tokenizer file) and holds no weights."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"model_type": "standin"}')
    (directory / "tokenizer.json").write_text("{}")
    return directory


def parser(trials: int | None = None) -> argparse.ArgumentParser:
    """The options every fault benchmark takes: a seed, --write, and trials when it repeats."""
    ap = argparse.ArgumentParser()
    if trials:
        ap.add_argument("--trials", type=int, default=trials)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--write", action="store_true", help="append the result table to docs/BENCHMARKS.md")
    return ap
