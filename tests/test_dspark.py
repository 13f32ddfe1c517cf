"""DeepSeek-V4 with its DSpark drafter through omlx's overlay, on a tiny checkpoint in DSpark's layout built
here (tests/kit/dspark.py) and omlx's entry points played by the stand-in in tests/standins/omlx: the
overlay set up before load by meshd's adapter, an omlx that lacks an entry point or stages that did not load
named at load; a DeepSeek Harness (dsh) turn, reasoning_content and tool calls, through DeepSeek's template;
at TP4 on the ring, DSpark armed in the lockstep loop with drafted greedy and seeded answers the plain ones
token for token, the stand-in's 8-head kernel hidden at load (2 heads per rank), a refusal in the target's
verify falling back for that request with the ranks alive, and stages split without their all-reduce
caught by the lockstep digests."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from kit.dspark import build_dspark_model, standin_env
from agents.signatures import classify
from kit.demo_answers import endless
from kit.ranks import start_mesh
from kit.waiting import wait_for
from mlx_lm.chat_templates import deepseek_v32

from mlx_lm.utils import load_tokenizer

from runtime import openai_api as oa
from runtime.overlay import OMLX, overlay_for, unloaded

OVERLAY = ("--model-package", "omlx")


@pytest.fixture(scope="module")
def dspark_model(tmp_path_factory):
    return build_dspark_model(tmp_path_factory.mktemp("models") / "dspark")


def test_tensors_the_model_holds_no_place_for_are_named():
    checkpoint = ["lm_head.weight", "model.norm.weight", "mtp.0.main_proj.weight", "mtp.2.norm.weight"]
    assert unloaded(("mtp.",), checkpoint, ["lm_head.weight", "model.norm.weight"]) == checkpoint[2:]
    assert unloaded(("mtp.",), checkpoint, ["lm_head.weight", "mtp.0.main_proj.weight"]) == []
    assert unloaded(("mtp.",), checkpoint[:2], ["lm_head.weight"]) == []  # a checkpoint without stages
    assert overlay_for("omlx") is OMLX and overlay_for("runtime.overlays.demo_mtp").before_load == ()
    assert overlay_for(None) is None


def test_an_omlx_without_an_entry_point_meshd_calls_is_named_before_anything_is_set_up(dspark_model, tmp_path):
    with start_mesh(dspark_model, 1, tmp_path, *OVERLAY, env={**standin_env(), "OMLX_STUB_OLD": "noactive"}) as mesh:
        assert mesh.wait_exit(timeout=120) == [1]
        assert "omlx.patches.mlx_lm_mtp.set_mtp_active is missing in" in mesh.log(0), mesh.log(0)


LOAD = """
import sys
from pathlib import Path
import mlx.core as mx
from runtime.overlay import OMLX, OverlayError, set_up
from runtime.rank import load_sharded
set_up(OMLX)
try:
    model = load_sharded(Path(sys.argv[1]), mx.distributed.init(), lambda done, total: None, OMLX)
except OverlayError as e:
    sys.exit(str(e))
print(type(model).__module__, len(model.mtp), model._omlx_dspark_decode_enabled)
"""


@pytest.mark.parametrize("old, out", [
    ("", "omlx.patches.deepseek_v4.deepseek_v4_model 3 True"),  # the stand-in's loader, which alone reads it: looked up after setup
    ("nodspark", "77 checkpoint tensors did not load (mtp.0."),  # built without stages: mtp.* dropped
])
def test_the_load_path_sets_up_the_overlay_first_and_names_stages_that_did_not_load(dspark_model, old, out):
    run = subprocess.run([sys.executable, "-c", LOAD, str(dspark_model)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **standin_env(), "OMLX_STUB_OLD": old})
    assert out in run.stdout + run.stderr, run.stdout + run.stderr


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
# dsh's turn after a tool call: the call's reasoning sent back with it, then the tool's result
DSH_TURN = [{"role": "user", "content": "Is it warm in Oslo?"},
            {"role": "assistant", "content": "", "reasoning_content": "I should look the weather up.",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 degrees, sunny"}]
LIMITS = oa.Limits("dspark", 0, 8192)


def test_a_dsh_turn_reaches_deepseeks_template_whole_and_reasoning_goes_out_under_both_names():
    req = oa.parse_request("chat", {"messages": DSH_TURN, "tools": [WEATHER]}, LIMITS)
    assert req.messages[1]["reasoning_content"] == "I should look the weather up."
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # as sent
    prompt = deepseek_v32.apply_chat_template(list(req.messages), tools=list(req.tools), add_generation_prompt=True,
                                              enable_thinking=True)
    # the reasoning is after the last user turn, so the template renders it back: the prompt is what was said
    assert "I should look the weather up.</think>" in prompt
    assert '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>' in prompt
    assert "<result>21 degrees, sunny</result>" in prompt and prompt.endswith("<think>")
    message = oa.completion_body(req, "r", 0, "Yes.", "stop", {}, reasoning="Warm enough.")["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "Warm enough."
    delta = oa.chunk_body(req, "r", 0, None, None, reasoning="Warm")["choices"][0]["delta"]
    assert delta["reasoning_content"] == delta["reasoning"] == "Warm"
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request("chat", {"messages": [DSH_TURN[0], {**DSH_TURN[1], "reasoning_content": ["x"]}]}, LIMITS)
    assert (e.value.status, e.value.param) == (400, "messages[1].reasoning_content")


PROMPT = "The ranks step in lockstep: each token needs an all-reduce across the ring."
REFUSE_AT = 100  # the stand-in target's verify refuses past this many positions (MESHD_FAULT_TARGET_REFUSE_AT)
ASKS = {"greedy": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16},
        "seeded": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0.9,
                   "seed": 7, "logprobs": True, "top_logprobs": 2},
        "long": {"messages": [{"role": "user", "content": PROMPT * 2}], "max_tokens": 16}}  # past REFUSE_AT


def answers(url: str, model) -> dict:
    out = {}
    for name, body in ASKS.items():
        r = requests.post(f"{url}/v1/chat/completions", timeout=300, json={**body, **endless(model)})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out[name] = (choice["message"]["content"], r.json()["usage"]["completion_tokens"],
                     [round(t["logprob"], 2) for t in (choice.get("logprobs") or {}).get("content", [])])
    return out


@pytest.fixture(scope="module")
def plain(dspark_model, tmp_path_factory):
    with start_mesh(dspark_model, 4, tmp_path_factory.mktemp("plain"), *OVERLAY, "--drafter", "off",
                    env=standin_env()) as mesh:
        mesh.wait_ready(300)
        return answers(mesh.url, dspark_model)


@pytest.fixture(scope="module")
def drafted(dspark_model, tmp_path_factory):
    with start_mesh(dspark_model, 4, tmp_path_factory.mktemp("drafted"), *OVERLAY, "--prefill-step-size", "16",
                    env={**standin_env(), "MESHD_FAULT_TARGET_REFUSE_AT": str(REFUSE_AT)}) as mesh:
        mesh.wait_ready(300)
        short = answers(mesh.url, dspark_model)
        dsh = requests.post(f"{mesh.url}/v1/chat/completions", timeout=300,
                            json={"messages": DSH_TURN, "tools": [WEATHER], "max_tokens": 4,
                                  "chat_template_kwargs": {"enable_thinking": True}})
        wait_for(lambda: mesh.status(0)["state"] == "ready", 60, "rank 0 idle again")
        status = [mesh.status(r) for r in range(4)]
        # B>1: two requests that arrive while the drafter has one wait for it, then run batched together
        with ThreadPoolExecutor(3) as pool:
            def ask():
                return requests.post(f"{mesh.url}/v1/chat/completions", timeout=300,
                                     json={**ASKS["greedy"], **endless(dspark_model)}).json()
            first = pool.submit(ask)
            wait_for(lambda: mesh.status(0)["tokens"] > status[0]["tokens"], 120, "the lone request drafting")
            pair = [pool.submit(ask), pool.submit(ask)]
            together = [first.result(), *(f.result() for f in pair)]
        batched = mesh.status(0)
        alone = ask()  # the drafter re-armed between requests
        wait_for(lambda: mesh.status(0)["state"] == "ready", 60, "rank 0 idle again")
        yield {"answers": short, "dsh": dsh, "status": status, "logs": [mesh.log(r) for r in range(4)],
               "alive": [p.poll() is None for p in mesh.procs], "together": together, "alone": alone,
               "before": status[0], "batched": batched, "after": mesh.status(0)}


def test_dspark_drafts_at_tp4_and_its_answers_are_the_plain_ones_token_for_token(drafted, plain):
    assert drafted["answers"] == plain  # greedy, seeded (and its log probabilities), and the long one
    assert plain["greedy"][1] == 16 and plain["seeded"][2]
    first = drafted["status"][0]
    assert first["drafter"] == "dspark" and 0 < first["draft_accepted"] <= first["draft_proposed"]
    counts = {(s["draft_proposed"], s["draft_accepted"], s["draft_fallbacks"]) for s in drafted["status"]}
    assert len(counts) == 1  # every rank drafted and kept the same
    assert all("drafter armed: DSpark's 3 stages, blocks of 5 drafts" in log for log in drafted["logs"])


def test_more_than_one_request_runs_batched_and_the_drafter_rearms_between_requests(drafted, plain):
    texts = [r["choices"][0]["message"]["content"] for r in [*drafted["together"], drafted["alone"]]]
    assert texts == [plain["greedy"][0]] * 4
    before, batched, after = drafted["before"], drafted["batched"], drafted["after"]
    lookups = lambda s: s["tape_hits"] + s["tape_misses"] + s["tape_not_reusable"]
    assert lookups(batched) - lookups(before) == 2  # the pair went to the batch engine (its tape looked up)
    assert after["draft_proposed"] > batched["draft_proposed"] and lookups(after) == lookups(batched)


def test_a_kernel_that_refuses_the_heads_per_rank_is_hidden_at_load(drafted):
    assert all("kernel dspark_ring_gemm hidden: it refuses 2 heads per rank (ValueError: Unsupported DSpark "
               "physical-ring GEMM layout.)" in log for log in drafted["logs"])


def test_a_refusal_in_the_targets_verify_falls_back_for_that_request_and_the_ranks_live(drafted):
    # the long prompt and the dsh turn, both past REFUSE_AT; their answers are the plain ones (the long one above)
    assert drafted["alive"] == [True] * 4 and drafted["status"][0]["draft_fallbacks"] == 2
    assert "the target's verify refused (ValueError: Unsupported DSpark physical-ring GEMM layout." in drafted["logs"][0]


def test_a_dsh_turn_through_the_mesh_reaches_the_template_with_its_reasoning(drafted, dspark_model):
    assert drafted["dsh"].status_code == 200, drafted["dsh"].text
    said = load_tokenizer(dspark_model).apply_chat_template(
        DSH_TURN, tools=[WEATHER], add_generation_prompt=True, enable_thinking=True)
    assert drafted["dsh"].json()["usage"]["prompt_tokens"] == len(said)  # the reasoning and the call rendered


def test_stages_split_without_their_all_reduce_are_caught_by_the_digests(dspark_model, tmp_path):
    with start_mesh(dspark_model, 2, tmp_path, *OVERLAY,
                    env={**standin_env(), "MESHD_FAULT_DSPARK_UNREDUCED": "1"}) as mesh:
        mesh.wait_ready(300)  # the readiness answer is one token: no draft is verified yet
        r = requests.post(f"{mesh.url}/v1/chat/completions", timeout=300, json=ASKS["greedy"])
        assert r.status_code == 503 and r.json()["error"]["code"] == "generation_failed"
        assert mesh.wait_exit(timeout=120) == [1, 1]
        line = next(l for l in mesh.log(0).splitlines() if "[meshd] divergence" in l)
        assert classify(line).name == "divergence"
