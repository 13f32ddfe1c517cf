"""`meshctl apply`: an edited mesh.toml's changes, each with what it needs (meshd/configdiff.py, pure), and on a real
two-rank mesh a changed runtime arg taken at the next generation while a changed node list is refused with its
command; the status names the config each generation runs."""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from common.tomlcheck import write_toml
from kit.configs import write_mesh
from kit.agents import make_agents
from kit.demo_answers import endless
from kit.meshctl import mesh_up, meshctl
from meshd import configdiff
from meshd.config import load
from meshd.configdiff import Needs


@pytest.fixture
def running(tmp_path, demo_model):
    return load(write_mesh(tmp_path, make_agents(tmp_path, 2), demo_model, runtime={"args": {"max_tokens": 3}}))


def with_runtime(cfg, **kw):
    return replace(cfg, runtime=replace(cfg.runtime, **kw))


@pytest.mark.parametrize("edit,key,needs", [
    (lambda c: with_runtime(c, args={"max_tokens": 6}), "runtime.args.max_tokens", Needs.GENERATION),
    (lambda c: with_runtime(c, args={"max_tokens": 3, "drafter": "off"}), "runtime.args.drafter", Needs.GENERATION),
    (lambda c: with_runtime(c, args={"max_tokens": 3, "snapshots": "off"}), "runtime.args.snapshots",
     Needs.GENERATION),
    (lambda c: with_runtime(c, env={"NCCL_DEBUG": "INFO"}), "runtime.env.NCCL_DEBUG", Needs.GENERATION),
    (lambda c: with_runtime(c, draft_model="/models/small"), "runtime.draft_model", Needs.GENERATION),
    (lambda c: with_runtime(c, seed=7), "runtime.seed", Needs.GENERATION),
    (lambda c: replace(c, proxy=replace(c.proxy, concurrency=2)), "proxy.concurrency", Needs.PROXY),
    (lambda c: replace(c, proxy=replace(c.proxy, listen="127.0.0.1:1")), "proxy.listen", Needs.PORTS),
    (lambda c: replace(c, ssh=replace(c.ssh, user="ops")), "ssh.user", Needs.NOTHING),
    (lambda c: replace(c, nodes=c.nodes[:1]), "nodes", Needs.NODES),
    (lambda c: replace(c, nodes=(replace(c.nodes[0], address="10.0.0.9"), c.nodes[1])), "nodes.node0.address",
     Needs.NODES),
    (lambda c: replace(c, backend="jaccl"), "backend", Needs.NODES),
    (lambda c: with_runtime(c, port=1), "runtime.port", Needs.PORTS),
    (lambda c: replace(c, control=replace(c.control, listen="127.0.0.1:1")), "control.listen", Needs.PORTS),
    (lambda c: with_runtime(c, model="/models/other"), "runtime.model", Needs.MODEL),
    (lambda c: with_runtime(c, model_package="omlx"), "runtime.model_package", Needs.MODEL),
    (lambda c: replace(c, recovery=replace(c.recovery, max_failures=9)), "recovery.max_failures", Needs.CONTROLLER),
    (lambda c: replace(c, name="other"), "name", Needs.CONTROLLER),
], ids=lambda v: v if isinstance(v, str) else None)
def test_each_change_says_what_applies_it(running, edit, key, needs):
    (change,) = configdiff.changes(running, edit(running))
    assert (change.key, change.needs) == (key, needs)
    assert change.needs.applies is (needs in (Needs.GENERATION, Needs.PROXY, Needs.NOTHING))
    assert configdiff.Change.from_wire(json.loads(json.dumps(change.wire()))) == change


def test_a_removed_node_is_one_change_of_the_node_list_and_named_with_its_command(running):
    (change,) = configdiff.changes(running, replace(running, nodes=running.nodes[:1]))
    assert change.line() == ('nodes: ["node0", "node1"] -> ["node0"]: needs `meshctl down`, then `meshctl up` '
                             "(the controller starts with the new node list)")


def test_a_digest_names_the_settings_not_the_file(running):
    running.path.write_text("# a comment\n" + running.path.read_text())
    assert configdiff.digest(load(running.path)) == configdiff.digest(running)
    assert configdiff.digest(with_runtime(running, seed=1)) != configdiff.digest(running)
    assert configdiff.changes(running, running) == []


def test_the_store_keeps_the_newest_generations_digests(running):
    kept = {}
    for g in range(1, configdiff.KEPT + 6):
        kept = configdiff.remember(kept, g, f"d{g}")
    assert len(kept) == configdiff.KEPT and min(map(int, kept)) == 6 and kept[str(configdiff.KEPT + 5)] == "d105"
    assert configdiff.view(running, kept, 5)["running"] == ""  # pruned, or started before digests were kept
    seen = configdiff.view(running, kept, 104)
    assert seen["running"] == "d104" and seen["next"] == configdiff.digest(running)
    assert list(seen["generations"]) == [str(g) for g in range(96, 106)]


def answer_tokens(proxy: str, model: Path) -> int:
    """The length of an answer whose request names none (the runtime's max_tokens, as meshd-proxy applies it)."""
    r = requests.post(f"{proxy}/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "hello"}], **endless(model)})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


def edit(mesh: Path, change) -> None:
    raw = tomllib.loads(mesh.read_text())
    change(raw)
    write_toml(mesh, raw)


def test_apply_takes_a_changed_runtime_arg_at_the_next_generation_and_refuses_a_changed_node_list(tmp_path,
                                                                                                  demo_model):
    with mesh_up(tmp_path, demo_model, runtime={"args": {"max_tokens": 3, "model_name": "demo"}}) as (mesh, _):
        before = json.loads(meshctl(mesh, "status", "--json").stdout)
        first = before["config"]
        assert first["running"] == first["next"] == configdiff.digest(load(mesh))
        assert f"config: {first['running']} (generation {before['generation']})" in meshctl(mesh, "status").stdout
        assert answer_tokens(before["urls"]["proxy"], demo_model) == 3
        assert "nothing changed" in meshctl(mesh, "apply").stdout

        edit(mesh, lambda raw: raw["runtime"]["args"].update(max_tokens=6))
        assert "has changed since" in meshctl(mesh, "status").stdout
        applied = meshctl(mesh, "apply", "--wait")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert "runtime.args.max_tokens: 3 -> 6: applies at the next generation" in applied.stdout
        assert "meshd-proxy handed over" in applied.stdout
        after = json.loads(meshctl(mesh, "status", "--json").stdout)
        assert after["generation"] > before["generation"]
        assert after["config"]["running"] == configdiff.digest(load(mesh)) != first["running"]
        assert after["config"]["generations"][str(before["generation"])] == first["running"]
        assert answer_tokens(after["urls"]["proxy"], demo_model) == 6

        edit(mesh, lambda raw: (raw.update(nodes=raw["nodes"][:1]), raw["runtime"]["args"].update(max_tokens=9)))
        refused = meshctl(mesh, "apply")
        assert refused.returncode == 1 and "nothing was applied: 1 of the 2 changes need more" in refused.stderr
        assert ('nodes: ["node0", "node1"] -> ["node0"]: needs `meshctl down`, then `meshctl up`' in refused.stdout
                and "runtime.args.max_tokens: 6 -> 9: applies at the next generation" in refused.stdout)
        still = json.loads(meshctl(mesh, "status", "--json").stdout)
        assert (still["generation"], still["config"]["next"]) == (after["generation"], after["config"]["running"])
