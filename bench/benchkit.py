"""What the benchmarks share: driving the demo mesh through meshctl, and
appending a result table to docs/BENCHMARKS.md."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def meshctl(home: Path, *args: str, check: bool = True) -> str:
    """Run meshctl against the demo mesh living in `home` ($MESHD_HOME)."""
    env = {**os.environ, "MESHD_HOME": str(home)}
    env.pop("MESHD_CONFIG", None)
    r = subprocess.run([sys.executable, "-m", "meshd.cli", *args], env=env, capture_output=True, text=True,
                       timeout=600)
    if check and r.returncode != 0:
        raise SystemExit(f"meshctl {' '.join(args)} failed: {r.stdout}{r.stderr}")
    return r.stdout


def meshctl_for(mesh: Path, *args: str, check: bool = True) -> str:
    """Run meshctl against the mesh described by `mesh` (a mesh.toml)."""
    return meshctl(mesh.parent, "--config", str(mesh), *args, check=check)


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
