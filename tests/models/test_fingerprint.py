"""The weights' fingerprint sees every byte: a tensor in the middle of a weight file changed by +0.05 (outside
its header and its last MiB, where a LoRA merged into attention lands) gives another fingerprint, and on a
2-rank mesh the old weights' prefix snapshots are no longer restored once the file changed. An unchanged file
is not hashed again (its digest comes from the cache); a change that sets the file's mtime back is still
seen; so is a change of the tokenizer."""

import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest

from common import fingerprint
from common.fingerprint import weights_digest
from kit.agents import make_agents
from kit.snapshots import Gen
from kit.weights import nudge
from runtime.models.demo_model import DemoModelSpec, build_demo_model

BIG = DemoModelSpec(hidden_size=256, intermediate_size=512, seed=3)  # 3.7 MB in one file


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("models") / "big", BIG)


def copy(model: Path, to: Path) -> Path:
    shutil.copytree(model, to)
    return to


def test_a_tensor_changed_in_the_middle_of_the_file_gives_another_fingerprint(big_model, tmp_path):
    model = copy(big_model, tmp_path / "m")
    before = weights_digest(model)
    start, end, size = nudge(model)
    header = 8 + struct.unpack("<Q", (model / "model.safetensors").read_bytes()[:8])[0]
    assert header < start and end < size - (1 << 20), "the issue's case: outside the header and the last MiB"
    assert weights_digest(model) != before


def test_an_unchanged_file_is_not_hashed_again_and_a_change_that_sets_mtime_back_is_seen(big_model, tmp_path):
    model = copy(big_model, tmp_path / "m")
    weights = model / "model.safetensors"
    time.sleep(fingerprint.RACY_NS / 1e9)  # a file changed as it is hashed is never cached: this one is older
    first = weights_digest(model)
    cached = json.loads(fingerprint.cache_path().read_text())
    assert list(cached) == [str(weights.resolve())]
    assert oct(fingerprint.cache_path().stat().st_mode & 0o777) == "0o600"
    # A cache entry is trusted only for the very file it was made from: a forged digest under the file's
    # own stamp is what the next call returns, which shows that it did not read the file again.
    cached[str(weights.resolve())][5] = "00" * 32
    fingerprint.cache_path().write_text(json.dumps(cached))
    forged = weights_digest(model)
    assert forged != first
    mtime = weights.stat().st_mtime_ns
    nudge(model, delta=0.0)  # the same bytes written again: ctime moves
    os.utime(weights, ns=(mtime, mtime))
    assert weights_digest(model) == first, "hashed again (ctime moved though mtime was set back)"
    nudge(model)
    os.utime(weights, ns=(mtime, mtime))
    assert weights_digest(model) not in (first, forged)


def test_the_tokenizer_is_part_of_the_fingerprint(big_model, tmp_path):
    model = copy(big_model, tmp_path / "m")
    before = weights_digest(model)
    (model / "tokenizer_config.json").write_text(
        (model / "tokenizer_config.json").read_text().replace("{", '{"chat_template": "x", ', 1))
    assert weights_digest(model) != before


def test_a_mesh_does_not_restore_the_old_weights_snapshots_once_a_tensor_in_the_middle_changed(big_model,
                                                                                                  tmp_path):
    model = copy(big_model, tmp_path / "model")
    agents = make_agents(tmp_path / "mesh", 2)
    for agent in agents:
        agent.start(env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    prompts = [[{"role": "user", "content": f"tell me about {w}"}] for w in ("rivers", "lakes", "seas")]
    fresh = {}  # by generation: the first prompt's cached tokens, and the snapshots each rank restored
    try:
        for g in (1, 2, 3):
            gen = Gen(agents, model, g)
            try:
                restored = [gen.restored(r)["snapshots_restored"] for r in range(2)] if g > 1 else [0, 0]
                fresh[g] = ([gen.chat(p)[1] for p in prompts][0], restored)
                gen.settled(0), gen.settled(1)
            finally:
                gen.stop()
            if g == 2:
                nudge(model)
    finally:
        for agent in agents:
            agent.kill()
    assert fresh[2][0] > fresh[1][0] and min(fresh[2][1]) >= 1, f"the same weights' snapshots restored: {fresh}"
    assert fresh[3] == (fresh[1][0], [0, 0]), f"none of the old weights' restored: {fresh}"
