"""Models by Hugging Face id: `meshctl model pull` takes a repo from one
node's cache (as huggingface_hub left it) to the others' over real SSH, with
the fingerprint doctor compares agreeing on every node; a mesh whose
[runtime] model is the repo id then serves from each node's own cache."""

import json
import os
import subprocess
import sys

import pytest
import requests

from common.modelref import ModelNotFound, is_repo_id, resolve, served_name
from kit.agents import make_agents
from kit.configs import write_mesh
from kit.hfcache import plant
from kit.meshctl import meshctl, stop_controller
from kit.sshd import start_fleet
from meshd.meshctl.modelpull import Entry, wanted

REPO = "test-org/tiny-demo"


@pytest.mark.parametrize("model,repo", [("mlx-community/Qwen3-8B-4bit", True), ("/Volumes/models/x", False),
                                        ("./models/x", False), ("~/models/x", False), ("a/b/c", False),
                                        ("org/", False), ("deepseek-ai/DeepSeek-V4.1", True)])
def test_what_a_model_names(model, repo):
    assert is_repo_id(model) == repo


def test_the_served_name_is_the_repo_id_or_the_directory():
    assert served_name("mlx-community/Qwen3-8B-4bit") == "mlx-community/Qwen3-8B-4bit"
    assert served_name("/Volumes/models/dsv4") == "dsv4"
    assert served_name("/Volumes/models/dsv4", "deepseek") == "deepseek"


def test_only_missing_or_changed_files_are_copied():
    entries = [Entry("dir", "blobs", "", 0), Entry("file", "blobs/a", "", 10), Entry("file", "blobs/b", "", 20),
               Entry("link", "snapshots/r/config.json", "../../blobs/a", 0)]
    assert [e.path for e in wanted(entries, {"blobs/a": 10, "blobs/b": 7}, force=False)] == ["blobs/b"]
    assert [e.path for e in wanted(entries, {"blobs/a": 10, "blobs/b": 20}, force=True)] == ["blobs/a", "blobs/b"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = start_fleet(tmp_path_factory.mktemp("hf"), 3, env={"HF_HUB_OFFLINE": "1"})
    yield f
    f.stop()


def hub(node) -> "os.PathLike":
    return node.home / ".cache" / "huggingface" / "hub"


def test_model_pull_copies_a_repo_to_every_node_and_the_mesh_serves_it_by_name(fleet, demo_model, tmp_path):
    source, *others = fleet.nodes
    snapshot = plant(hub(source), REPO, demo_model)
    three = make_agents(tmp_path / "pull", 3)  # the pull goes over SSH only: these agents never start
    pull_mesh = write_mesh(tmp_path / "pull", three, REPO, ssh_of=fleet.ssh_of(three), ssh=fleet.ssh_settings(tmp_path))
    r = meshctl(pull_mesh, "model", "pull", REPO, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"node0: downloading {REPO}" in r.stdout and f"{REPO}: the same on 3 nodes (fingerprint" in r.stdout
    for node in others:
        copy = hub(node) / f"models--{REPO.replace('/', '--')}" / "snapshots" / snapshot.name
        assert (copy / "config.json").is_symlink()
        assert (copy / "config.json").read_bytes() == (snapshot / "config.json").read_bytes()
    again = meshctl(pull_mesh, "model", "pull", REPO, timeout=300)
    assert again.returncode == 0 and "node1: 0 files to copy" in again.stdout  # kept, not copied twice

    # The mesh by repo id: each agent resolves it in its own node's cache.
    agents = make_agents(tmp_path / "serve", 2, stall={"base": 10})
    mesh = write_mesh(tmp_path / "serve", agents, REPO, runtime={"args": {"max_tokens": 4, "max_context": 512}})
    for a, node in zip(agents, fleet.nodes):
        a.start(env={"HF_HUB_CACHE": str(hub(node)), "HF_HUB_OFFLINE": "1"})
    try:
        up = meshctl(mesh, "up", timeout=240)
        assert up.returncode == 0, up.stdout + up.stderr
        proxy = json.loads(meshctl(mesh, "status", "--json").stdout)["urls"]["proxy"]
        assert requests.get(f"{proxy}/models", timeout=30).json()["data"][0]["id"] == REPO
        chat = requests.post(f"{proxy}/chat/completions", timeout=120,
                             json={"model": REPO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert chat.status_code == 200 and chat.json()["model"] == REPO
        (rank,) = [r for r in agents[1].ranks() if r["state"] != "exited"]
        log = agents[1].dir / "state" / f"gen-{rank['generation']}" / f"rank-{rank['rank']}" / "rank.log"
        assert f"from {hub(fleet.nodes[1])}" in log.read_text()  # node1's own copy
    finally:
        stop_controller(mesh)
        for a in agents:
            a.kill()


def test_a_repo_not_in_a_nodes_cache_names_the_pull(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = subprocess.run([sys.executable, "-c", "from common.modelref import resolve; resolve('org/absent', 'n1')"],
                       env={**os.environ, "HF_HUB_CACHE": str(tmp_path)}, capture_output=True, text=True)
    assert "org/absent is not in node n1's Hugging Face cache" in r.stderr and "meshctl model pull org/absent" in r.stderr
    with pytest.raises(ModelNotFound, match="does not exist on node n2"):
        resolve("/no/such/model", "n2")
