"""The checkpoint's own drafter at TP4: a demo model with a DeepSeek-style MTP
head (model type demo_mtp, registered by the overlay runtime.models.overlays.demo_mtp)
on four real ranks over the ring, through real agents and a controller.
Drafted answers are the plain answers token for token, past the prefill chunk;
a head sharded without its all-reduce is caught by the lockstep digests. (A
head that refuses a shape falls back for that request: tests/engine/test_drafter_refusals.py
in one process, and DSpark's refusal in lockstep on four ranks in tests/models/test_dspark.py.)"""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from agents.signatures import classify
from kit.agents import make_agents
from kit.configs import write_mesh
from kit.demo_answers import endless
from kit.meshctl import meshctl, stop_controller
from kit.ranks import start_mesh
from kit.waiting import wait_for
from runtime.models.demo_model import DemoModelSpec, build_demo_model

OVERLAY = ("--model-package", "runtime.models.overlays.demo_mtp")
PROMPT = "The ranks step in lockstep: each token needs an all-reduce across the ring. " * 3  # > 16 tokens


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("models") / "mtp", DemoModelSpec(mtp=True, mtp_train_steps=30))


@pytest.fixture(scope="module")
def plain(mtp_model, tmp_path_factory):
    """The answers without the drafter (continuous batching), the yardstick."""
    with start_mesh(mtp_model, 4, tmp_path_factory.mktemp("plain"), *OVERLAY, "--drafter", "off",
                    "--prefill-step-size", "16") as mesh:
        mesh.wait_ready()
        assert all(mesh.status(r)["drafter"] == "" for r in range(4))
        return answers(mesh.url, mtp_model)


def answers(url: str, model, at_once: bool = False) -> list[dict]:
    """Three answers, asked one after the other or `at_once`."""
    def ask(body: dict) -> dict:
        r = requests.post(f"{url}/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": PROMPT}], **endless(model), **body})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return {"content": choice["message"]["content"], "tokens": r.json()["usage"]["completion_tokens"],
                "logprobs": [t["logprob"] for t in (choice.get("logprobs") or {}).get("content", [])]}

    bodies = ({"max_tokens": 40}, {"max_tokens": 30, "temperature": 0.9, "seed": 7},
              {"max_tokens": 24, "logprobs": True, "top_logprobs": 2})
    if not at_once:
        return [ask(body) for body in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(ask, bodies))


def same(a: list[dict], b: list[dict]) -> bool:
    """The same answers, token for token; log probabilities equal but for float noise (a verify step
    computes several places at once, in other shapes than one at a time)."""
    return all(x["content"] == y["content"] and x["tokens"] == y["tokens"] and len(x["logprobs"]) == len(y["logprobs"])
               and all(abs(p - q) < 0.01 for p, q in zip(x["logprobs"], y["logprobs"])) for x, y in zip(a, b))


def test_drafted_answers_equal_plain_answers_at_tp4_through_meshd(mtp_model, plain, tmp_path):
    """Four agents and a controller with [runtime] model_package: doctor finds the overlay on every node, the
    ranks arm the head, the answers through the proxy are the plain ones, asked one after the other and all at
    once (the proxy admits them together; they are drafted as rows of one batch), the agents export the counts."""
    agents = make_agents(tmp_path, 4, stall={"base": 10})
    for a in agents:
        a.start()
    mesh = write_mesh(tmp_path, agents, mtp_model, runtime={"model_package": OVERLAY[1],
                                                            "args": {"prefill_step_size": 16}})
    try:
        up = meshctl(mesh, "up")
        assert up.returncode == 0, up.stdout + up.stderr
        overlay = [c for c in json.loads(meshctl(mesh, "doctor", "--json").stdout) if c["name"] == "overlay"]
        assert len(overlay) == 4 and all(c["ok"] for c in overlay), overlay
        proxy = json.loads(meshctl(mesh, "status", "--json").stdout)["urls"]["proxy"].removesuffix("/v1")
        drafted = answers(proxy, mtp_model)
        together = answers(proxy, mtp_model, at_once=True)

        def counts():
            text = "".join(a.get("/metrics").text for a in agents)
            armed = re.findall(r"^meshd_agent_rank_drafter_armed\{[^}]*\} 1\.0$", text, re.M)
            found = {kind: set(re.findall(rf'^meshd_agent_rank_draft_tokens_total{{[^}}]*kind="{kind}"[^}}]*}} '
                                          r"([0-9.]+)$", text, re.M)) for kind in ("proposed", "accepted")}
            found["batched"] = set(re.findall(r"^meshd_agent_rank_draft_batched_steps_total\{[^}]*\} ([0-9.]+)$",
                                              text, re.M))
            return len(armed) == 4 and all(len(v) == 1 for v in found.values()) and found
        found = wait_for(counts, 10, "every rank's draft counts in /metrics, the same")
    finally:
        stop_controller(mesh)
        for a in agents:
            a.kill()
    assert same(drafted, plain), (drafted, plain)
    assert same(together, plain), (together, plain)
    assert float(found["batched"].pop()) > 0  # the three drafted together at some steps
    assert plain[0]["tokens"] == 40 and plain[2]["logprobs"]
    proposed, accepted = float(found["proposed"].pop()), float(found["accepted"].pop())
    assert proposed > 0 and 0 < accepted <= proposed  # the head, distilled a little, guesses right at times


def test_a_head_sharded_without_its_all_reduce_is_caught_by_the_digests(mtp_model, tmp_path):
    with start_mesh(mtp_model, 4, tmp_path, *OVERLAY, env={"MESHD_FAULT_MTP_UNREDUCED": "1"}) as mesh:
        mesh.wait_ready()  # the readiness answer is one token: no draft is verified yet
        r = requests.post(f"{mesh.url}/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 30,
                                **endless(mtp_model)})
        assert r.status_code == 503 and r.json()["error"]["code"] == "generation_failed"
        assert mesh.wait_exit() == [1, 1, 1, 1]
        line = next(l for l in mesh.log(0).splitlines() if "[meshd] divergence" in l)
        assert classify(line).name == "divergence"
