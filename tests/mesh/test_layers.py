"""The import map runs downwards only (docs/ARCHITECTURE.md): common <- agents, runtime <- meshd's base
<- meshd/nodes <- meshd/control, meshd/dataplane <- meshd/meshctl <- bench. Rooms of one layer do not import
each other: the control plane and the data plane meet only in meshd/seam.py. The data plane imports nothing of
the runtime (APART). Inside the runtime its rooms run downwards too (RUNTIME_ROOMS): the rank process at its top,
then the engine, the prefix store, the models. A project import sits at the top of its module, but for the few listed in LATE with the
reason each is late. The tests sit in rooms that mirror the code's folders (TEST_ROOMS)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOMS = {"common": 0, "agents": 1, "runtime": 1, "meshd": 2, "meshd.nodes": 3, "meshd.control": 4,
         "meshd.dataplane": 4, "meshd.meshctl": 5, "bench": 6}
TOPS = ("common", "agents", "runtime", "meshd", "bench")
# Rooms kept off a room below them: the data plane checks requests with the OpenAI wire both planes stand on
# (common/openai_api.py), not with rank code.
APART = {"meshd.dataplane": {"runtime"}}
# The runtime's rooms, bottom first: the models (overlays, families, DSpark's stages, pooled windows, the demo
# model), the prefix store (tape, snapshots, rates, cache cut-backs), the engine (requests, sampling, grammar,
# decoding and drafting), and the rank process at runtime/'s top (rank, lockstep, server, restore, wake, ...).
RUNTIME_ROOMS = {"runtime.models": 0, "runtime.prefix": 1, "runtime.engine": 2, "runtime": 3}
# Each room of tests/ and the folder of code it tests; "mesh" holds what runs across every plane (chaos, fuzzing,
# the listeners, security, metrics, the import map). A room is not named as a package: a process with tests/ on its
# path would find the room in the package's place.
TEST_ROOMS = {"agent": "agents", "control": "meshd/control", "dataplane": "meshd/dataplane", "meshctl": "meshd/meshctl",
              "nodes": "meshd/nodes", "rank": "runtime", "engine": "runtime/engine", "prefix": "runtime/prefix",
              "models": "runtime/models", "pinned": "runtime", "mesh": "."}
BENCH = {p.stem for p in (ROOT / "bench").glob("*.py")}  # a bench imports its neighbours by their bare names

# Project imports inside a function, each with why it waits until it runs.
MESHCTL = "meshctl's commands that reach nodes (SSH, the agents' HTTP API) load them when they run: 0.4 s a call"
LATE = {
    ("meshd.meshctl.cli", "common.logfile"): MESHCTL,
    ("meshd.meshctl.cli", "meshd.meshctl.modelpull"): MESHCTL,
    ("meshd.meshctl.cli", "meshd.meshctl.cache"): MESHCTL,
    ("meshd.meshctl.cli", "meshd.meshctl.completion"): MESHCTL,
    ("meshd.meshctl.cli", "meshd.meshctl.install"): MESHCTL,
    ("meshd.meshctl.cli", "meshd.config"): MESHCTL,
    ("meshd.meshctl.cli", "meshd.nodes.provision"): MESHCTL,
    ("meshd.meshctl.cli", "meshd.nodes.doctor"): MESHCTL,
    ("meshd.meshctl.cli", "meshd.nodes.ssh"): MESHCTL,
    ("meshd.meshctl.cli", "meshd.nodes.agentclient"): MESHCTL,
    ("meshd.meshctl.cli", "common.buildinfo"): MESHCTL,
    ("meshd.config", "common.tls"): "cryptography only where TLS is in play: meshctl starts fast",
    ("runtime.models.demo_model", "runtime.models.overlays.demo_mtp"): "importing it registers its model type into mlx-lm",
    ("bench.benchkit", "runtime.models.demo_model"): "MLX only for the benches that build a model",
}


def room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] in BENCH:
        return "bench"
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


def late_imports(source: str) -> set[str]:
    """The project modules imported inside a function or method (`from a import b` counts as a, or a.b
    where b is a module)."""
    found = set()
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [f"{node.module}.{a.name}" for a in node.names]
                    found |= {n if module_exists(n) else node.module for n in names}
                elif isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
    return {n for n in found if room(n) is not None}


def module_exists(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def wrong(module: str, imported: set[str]) -> list[str]:
    """The imports of `module` that run upwards or sideways, or into a room it is kept apart from."""
    mine = room(module)
    return sorted(n for n in imported if (theirs := room(n)) is not None and theirs != mine
                  and (ROOMS[theirs] >= ROOMS[mine] or theirs in APART.get(mine, ())))


def runtime_room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "runtime":
        return None
    return ".".join(parts[:2]) if ".".join(parts[:2]) in RUNTIME_ROOMS else "runtime"


def wrong_in_runtime(module: str, imported: set[str]) -> list[str]:
    """The imports of a runtime module that run upwards between the runtime's rooms."""
    mine = runtime_room(module)
    return sorted(n for n in imported if mine is not None and (theirs := runtime_room(n)) is not None
                  and RUNTIME_ROOMS[theirs] > RUNTIME_ROOMS[mine])


def modules():
    for path in sorted(p for top in TOPS for p in (ROOT / top).rglob("*.py")):
        yield ".".join(path.relative_to(ROOT).with_suffix("").parts), path


@pytest.mark.parametrize("module,imported,expected", [
    ("meshd.control.controller", {"meshd.config", "meshd.nodes.doctor", "common.states"}, []),
    ("meshd.control.controller", {"meshd.dataplane.proxy"}, ["meshd.dataplane.proxy"]),
    ("meshd.upstream", {"meshd.control", "meshd.control.fleet"}, ["meshd.control", "meshd.control.fleet"]),
    ("agents.watch", {"runtime.status"}, ["runtime.status"]),
    ("meshd.meshctl.cli", {"meshd.control.controllerd", "agents.config"}, []),
    ("bench.failover", {"meshd.meshctl.ports", "benchkit", "kit.waiting"}, []),
    ("meshd.meshctl.demo", {"benchkit"}, ["benchkit"]),
    ("runtime.rank", {"bench.ringwait"}, ["bench.ringwait"]),
    ("meshd.dataplane.proxy", {"common.openai_api", "meshd.seam"}, []),
    ("meshd.dataplane.exchange", {"runtime.openai_api", "runtime"}, ["runtime", "runtime.openai_api"]),
    ("meshd.control.controller", {"runtime.models.overlay"}, []),
])
def test_the_rule_itself(module, imported, expected):
    assert wrong(module, imported) == expected


@pytest.mark.parametrize("module,imported,expected", [
    ("runtime.rank", {"runtime.engine.rowwise", "runtime.prefix.snapshot", "runtime.models.dspark"}, []),
    ("runtime.engine.drafting", {"runtime.prefix.rollback", "runtime.models.pools", "runtime.engine.jobs"}, []),
    ("runtime.engine.drafting", {"runtime.lockstep"}, ["runtime.lockstep"]),
    ("runtime.prefix.tape", {"runtime.engine.jobs", "runtime.models.overlay"}, ["runtime.engine.jobs"]),
    ("runtime.models.dspark", {"runtime.prefix", "runtime.models.pools"}, ["runtime.prefix"]),
    ("meshd.control.controller", {"runtime.lockstep"}, []),
])
def test_the_runtime_rule_itself(module, imported, expected):
    assert wrong_in_runtime(module, imported) == expected


def test_the_runtime_rooms_import_downwards():
    found = {module: bad for module, path in modules() if (bad := wrong_in_runtime(module, imports(path)))}
    assert found == {}


@pytest.mark.parametrize("source,late", [
    ("import json\nfrom common import procs\n", set()),
    ("def f():\n    from common import procs\n    import json\n", {"common.procs"}),
    ("class A:\n    async def f(self):\n        from meshd.nodes.ssh import SshError\n", {"meshd.nodes.ssh"}),
    ("def f():\n    import benchkit\n", {"benchkit"}),
])
def test_the_late_import_rule_itself(source, late):
    assert late_imports(source) == late


def test_every_import_runs_downwards_and_the_data_plane_none_into_the_runtime():
    found = {}
    for module, path in modules():
        if bad := wrong(module, imports(path)):
            found[module] = bad
    assert found == {}


def test_project_imports_sit_at_the_top_of_their_module():
    found = {(module, name) for module, path in modules() for name in late_imports(path.read_text())}
    assert found - set(LATE) == set(), "move these imports to the top of their module, or list them in LATE"
    assert set(LATE) - found == set(), "these are at the top now: take them out of LATE"


def test_every_test_sits_in_a_room_that_mirrors_a_folder_of_code():
    tests = ROOT / "tests"
    rooms = {p.parent.relative_to(tests).as_posix() for p in tests.rglob("test_*.py") if "standins" not in p.parts}
    assert rooms == set(TEST_ROOMS), "a test file belongs in one of TEST_ROOMS' folders (see its comment)"
    assert all((ROOT / code).is_dir() for code in TEST_ROOMS.values())
    assert set(TEST_ROOMS) & set(TOPS) == set()
