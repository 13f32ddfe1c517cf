import os
import time
from collections import Counter
from pathlib import Path

import pytest

from meshd.meshctl.ports import SPAN
from runtime.models.demo_model import DemoModelSpec, build_demo_model

# Each xdist worker picks its ports, and the processes it starts theirs, in a span of its own
# (meshd/meshctl/ports.py): two workers never pick one port before either binds it.
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    _worker, _workers = int(os.environ["PYTEST_XDIST_WORKER"][2:]), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    _width = (SPAN[1] - SPAN[0]) // _workers
    os.environ["MESHD_PORT_SPAN"] = f"{SPAN[0] + _worker * _width}-{SPAN[0] + (_worker + 1) * _width}"

# tests/pinned runs on its own, named, in .venv-omlx at omlx's pins (scripts/test runs it after the rest)
collect_ignore = ["pinned"]

# The slowest files first, as a run of the suite on two workers measured them (--durations): the run then ends
# on short files, not with one worker alone on a long one.
SLOW_FIRST = ["test_controller.py", "test_demo_mesh.py", "test_demo_up_down.py", "test_recycle.py", "test_proxyd.py",
              "test_agent_mesh.py", "test_controller_ground.py", "test_quarantine.py", "test_chaos.py", "test_meshes.py",
              "test_fuzz.py", "test_provision.py", "test_families.py", "test_doctor.py", "test_takeover.py",
              "test_listeners.py", "test_dspark.py", "test_reboot.py", "test_standby.py", "test_migration.py",
              "test_mtp.py", "test_observability.py", "test_structured_output.py", "test_agents_install.py",
              "test_fingerprint.py", "test_rank_lifecycle.py", "test_models.py", "test_wake.py", "test_own_driver.py",
              "test_snapshots.py", "test_security.py", "test_engine.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))
    # Under pytest 9.2 schemathesis gives every API operation's item its test's node id, and xdist keeps one
    # item per node id: without the operation in the id the suite fuzzed one operation of each API only.
    for item in items:
        label = getattr(item, "operation_label", None)
        if label and not item.nodeid.endswith("]"):
            item._id = item._id.with_params(label)


FILE_SECONDS: Counter[str] = Counter()  # each file's setup, call and teardown seconds, as the workers reported them
STARTED = time.monotonic()


def pytest_runtest_logreport(report):
    FILE_SECONDS[report.nodeid.partition("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    """The slowest files and the run's totals, for each landing's note (and SLOW_FIRST above) to quote."""
    if not FILE_SECONDS or hasattr(terminalreporter.config, "workerinput"):
        return
    terminalreporter.section("slowest files")
    for path, seconds in FILE_SECONDS.most_common(15):
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
    counts = {k: len(terminalreporter.stats.get(k, [])) for k in ("passed", "skipped", "failed", "error")}
    terminalreporter.write_line(f"total: {time.monotonic() - STARTED:.0f}s wall, {sum(FILE_SECONDS.values()):.0f}s "
                                f"in tests over {len(FILE_SECONDS)} files; " +
                                ", ".join(f"{n} {k}" for k, n in counts.items()))


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("models") / "demo")


@pytest.fixture(scope="session")
def draft_model(tmp_path_factory) -> Path:
    spec = DemoModelSpec(hidden_size=32, num_hidden_layers=1, intermediate_size=64, seed=7)
    return build_demo_model(tmp_path_factory.mktemp("models") / "draft", spec)


@pytest.fixture(scope="session")
def thinking_model(tmp_path_factory) -> Path:
    """The demo model with <think> tokens and a template that opens a think block (DeepSeek-R1's way)."""
    return build_demo_model(tmp_path_factory.mktemp("models") / "thinking", DemoModelSpec(thinking=True))


@pytest.fixture(scope="session")
def deep_model(tmp_path_factory) -> Path:
    """Many layers and wider, so load and prefill take long enough to watch."""
    spec = DemoModelSpec(hidden_size=256, num_hidden_layers=24, intermediate_size=512, seed=3)
    return build_demo_model(tmp_path_factory.mktemp("models") / "deep", spec)


@pytest.fixture(scope="session")
def reference(demo_model):
    """Single-process greedy decoding of the demo model, the yardstick for the mesh."""
    from mlx_lm import load
    from mlx_lm.generate import generate

    model, tokenizer = load(str(demo_model))

    def run(prompt_ids: list[int], max_tokens: int) -> str:
        return generate(model, tokenizer, prompt_ids, max_tokens=max_tokens, verbose=False)

    run.tokenizer = tokenizer
    return run
