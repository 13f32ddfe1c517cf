"""The first hash of a large model outlasts any caller's wait (a 100 GB model's, the agent's facts call's
30 s): a real agent answers GET /v1/node at once with how far the hash is, hashes on behind, and a caller
that asks again gets the fingerprint. The doctor reads a node still hashing as not known to differ. The
fingerprint a mesh reports is the one its rank loaded: weights replaced after the agent hashed them are
reported as the new ones, and weights changed while the rank loaded them as unknown."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time

import pytest

from agents.node import HASH_WAIT, model_fingerprint
from common.fingerprint import loaded_digest, stamps, weights_digest
from kit.agents import make_agents
from kit.snapshots import Gen
from kit.waiting import wait_for
from meshd.nodes import doctor

SIZE = 3 << 30  # bytes of weights, sparse on disk: seconds of hashing on two cores, no disk written


@pytest.fixture
def large_model(tmp_path):
    model = tmp_path / "large"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "U8", "shape": [SIZE - 64], "data_offsets": [0, SIZE - 64]}}).encode()
    header += b" " * (56 - len(header))
    with open(model / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(SIZE)
    return model


def test_a_first_hash_is_answered_with_its_progress_at_once_and_its_fingerprint_when_asked_again(
        tmp_path, large_model, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the agent's digest cache is the test's
    [agent] = make_agents(tmp_path, 1)
    agent.start(env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        asked = time.monotonic()
        first = agent.get("/v1/node", params={"model": str(large_model)}).json()["model"]
        waited = time.monotonic() - asked
        assert first["present"] and first["fingerprint"] == "" and first["bytes"] == SIZE, first
        assert 0 <= first["hashing"]["done_bytes"] < first["hashing"]["total_bytes"] == SIZE
        assert waited < HASH_WAIT + 10  # a ceiling for a hang: it did not wait for the hash (seconds more)

        def hashed():
            m = agent.get("/v1/node", params={"model": str(large_model)}).json()["model"]
            return m["fingerprint"] and m
        done = wait_for(hashed, 120, "the fingerprint, asked again")
        assert "hashing" not in done
        assert done["fingerprint"] == model_fingerprint(str(large_model))["fingerprint"]  # the cache's, at once
    finally:
        agent.kill()


def test_the_doctor_reads_a_node_still_hashing_as_not_known_to_differ():
    done = {"present": True, "fingerprint": "ab" * 8, "bytes": 2**30, "weight_files": 1}
    hashing = {**done, "fingerprint": "", "hashing": {"done_bytes": 2**29, "total_bytes": 2**30}}
    checks = doctor.judge_model({"node0": {"model": done}, "node1": {"model": hashing}}, "/m")
    assert [c.ok for c in checks] == [True, True]
    assert "0.50 of 1.00 GiB hashed; run meshctl doctor again to compare" in checks[1].detail



def replace_weights(model) -> None:
    """The weight file replaced by a rename (another inode), one byte of its tensors changed."""
    path = model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    (model / "new").write_bytes(bytes(data))
    os.replace(model / "new", path)


def test_a_rank_reports_the_weights_it_loaded_not_those_its_agent_hashed_before(tmp_path, demo_model, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = shutil.copytree(demo_model, tmp_path / "m")
    [agent] = make_agents(tmp_path, 1)
    agent.start(env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        hashed = wait_for(lambda: agent.get("/v1/node", params={"model": str(model)}).json()["model"]["fingerprint"],
                          60, "the agent's hash")
        replace_weights(model)  # after the agent's hash, before the rank's load
        g = Gen([agent], model, 1)
        try:
            assert g.settled(0)["weights_fingerprint"] == weights_digest(model) != hashed
        finally:
            g.stop()
    finally:
        agent.kill()


def test_weights_changed_while_a_rank_loads_them_are_reported_as_unknown(tmp_path, demo_model, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = shutil.copytree(demo_model, tmp_path / "m")
    before = stamps(model)
    assert loaded_digest(model, before) == weights_digest(model)
    replace_weights(model)  # as if while it loaded
    assert loaded_digest(model, before) == ""
