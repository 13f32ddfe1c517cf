"""The import map runs downwards only (docs/ARCHITECTURE.md): common <- agents, runtime <- meshd's base
<- meshd/nodes <- meshd/control, meshd/dataplane <- meshd/meshctl. Rooms of one layer do not import
each other: the control plane and the data plane meet only in meshd/seam.py."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOMS = {"common": 0, "agents": 1, "runtime": 1, "meshd": 2, "meshd.nodes": 3, "meshd.control": 4,
         "meshd.dataplane": 4, "meshd.meshctl": 5}


def room(module: str) -> str | None:
    parts = module.split(".")
    for depth in (2, 1):
        if ".".join(parts[:depth]) in ROOMS:
            return ".".join(parts[:depth])
    return None


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def upward(module: str, imported: set[str]) -> list[str]:
    mine = room(module)
    return sorted(n for n in imported if (theirs := room(n)) is not None and theirs != mine
                  and ROOMS[theirs] >= ROOMS[mine])


@pytest.mark.parametrize("module,imported,wrong", [
    ("meshd.control.controller", {"meshd.config", "meshd.nodes.doctor", "common.states"}, []),
    ("meshd.control.controller", {"meshd.dataplane.proxy"}, ["meshd.dataplane.proxy"]),
    ("meshd.upstream", {"meshd.control", "meshd.control.fleet"}, ["meshd.control", "meshd.control.fleet"]),
    ("agents.watch", {"runtime.status"}, ["runtime.status"]),
    ("meshd.meshctl.cli", {"meshd.control.controllerd", "agents.config"}, []),
])
def test_the_rule_itself(module, imported, wrong):
    assert upward(module, imported) == wrong


def test_every_import_runs_downwards():
    wrong = {}
    for path in sorted(p for top in ("common", "agents", "runtime", "meshd") for p in (ROOT / top).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if bad := upward(module, imports(path)):
            wrong[module] = bad
    assert wrong == {}
