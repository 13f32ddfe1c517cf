"""DeepSeek-V4 with its DSpark drafter through omlx's overlay, on a tiny checkpoint in DSpark's layout built
here (tests/kit/dspark.py) and omlx's entry points played by the stand-in in tests/standins/omlx: the
overlay set up before load by meshd's adapter, an omlx that lacks an entry point or stages that did not load
named at load; a DeepSeek Harness (dsh) turn, reasoning_content and tool calls, through DeepSeek's template.
One TP4 mesh on the ring under real agents, a controller and meshd-proxy, every request through the proxy:
DSpark armed in the lockstep loop with drafted greedy and seeded answers the same token for token whether
asked alone (a batch of one) or at once (drafted row by row in one batch; plain decoding's answers are proven on
omlx's own model in tests/pinned), its counts in the agents' /metrics, a request asking for no drafts answering
the same and each answer's usage saying what it drafted (whole and streamed), counted by model in the proxy's
/metrics, several clients let through at once, the stand-in's 8-head kernel hidden at load (2 heads per rank) and counted, a
refusal in the target's verify falling back for that request with the ranks alive, a dsh turn through the
proxy; and at TP2, stages split without their all-reduce caught by the lockstep digests."""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import requests

from common import openai_api as oa
from kit.dspark import build_dspark_model, omlx_mesh, standin_env
from agents.signatures import classify
from kit.demo_answers import endless
from kit.meshctl import meshctl
from kit.ranks import start_mesh
from kit.waiting import wait_for
from mlx_lm.chat_templates import deepseek_v32

from mlx_lm.utils import load_tokenizer

from runtime.models.overlay import OMLX, drafter_off, overlay_for, unloaded

OVERLAY = ("--model-package", "omlx")


@pytest.fixture(scope="module")
def dspark_model(tmp_path_factory):
    return build_dspark_model(tmp_path_factory.mktemp("models") / "dspark")


def test_tensors_the_model_holds_no_place_for_are_named():
    checkpoint = ["lm_head.weight", "model.norm.weight", "mtp.0.main_proj.weight", "mtp.2.norm.weight"]
    assert unloaded(("mtp.",), checkpoint, ["lm_head.weight", "model.norm.weight"]) == checkpoint[2:]
    assert unloaded(("mtp.",), checkpoint, ["lm_head.weight", "mtp.0.main_proj.weight"]) == []
    assert unloaded(("mtp.",), checkpoint[:2], ["lm_head.weight"]) == []  # a checkpoint without stages
    assert overlay_for("omlx") is OMLX and overlay_for("runtime.models.overlays.demo_mtp").before_load == ()
    assert overlay_for(None) is None


def test_a_drafter_that_does_not_arm_says_why_and_how_to_get_one_that_does():
    methods = {m: None for m in OMLX.methods}
    armed, unarmed = SimpleNamespace(**methods, _omlx_dspark_decode_enabled=True), SimpleNamespace(**methods)
    v3, stages = ["mtp.0.e_proj.weight", "mtp.0.h_proj.weight"], ["mtp.0.main_proj.weight"]
    assert drafter_off(OMLX, armed, stages) is None
    assert drafter_off(None, unarmed, v3) is None and drafter_off(overlay_for("other"), unarmed, v3) is None
    assert drafter_off(OMLX, unarmed, v3) == ("drafter off, serving undrafted: the checkpoint holds a V3-shaped "
                                             f"MTP head (e_proj/h_proj), not DSpark's stages; {OMLX.draft_fix}")
    assert "the checkpoint holds no MTP tensors, not DSpark's stages" in drafter_off(OMLX, unarmed, [])
    published = drafter_off(OMLX, SimpleNamespace(make_mtp_cache=None), v3)
    assert "this omlx has no drafter for it (it lacks dspark_append_context, dspark_forward, dspark_markov)" in published
    assert OMLX.fix in published and OMLX.draft_fix in published


def test_an_omlx_without_an_entry_point_meshd_calls_is_named_before_anything_is_set_up(dspark_model, tmp_path):
    with start_mesh(dspark_model, 1, tmp_path, *OVERLAY, env={**standin_env(), "OMLX_STUB_OLD": "noactive"}) as mesh:
        assert mesh.wait_exit(timeout=120) == [1]
        assert "omlx.patches.mlx_lm_mtp.set_mtp_active is missing in" in mesh.log(0), mesh.log(0)


LOAD = """
import sys
from pathlib import Path
import mlx.core as mx
from runtime.models.overlay import OMLX, OverlayError, set_up
from runtime.rank import load_sharded
set_up(OMLX)
try:
    model = load_sharded(Path(sys.argv[1]), mx.distributed.init(), lambda done, total: None, OMLX)
except OverlayError as e:
    sys.exit(str(e))
print(type(model).__module__, len(model.mtp), model._omlx_dspark_decode_enabled)
"""


def test_the_load_path_sets_up_the_overlay_first_and_names_stages_that_did_not_load(dspark_model):
    # the stand-in's loader, which alone reads it, looked up after setup; an omlx without stages: mtp.* dropped
    outs = {"": "omlx.patches.deepseek_v4.deepseek_v4_model 3 True",
            "nodspark": "77 checkpoint tensors did not load (mtp.0."}
    runs = {old: subprocess.Popen([sys.executable, "-c", LOAD, str(dspark_model)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, **standin_env(), "OMLX_STUB_OLD": old}) for old in outs}
    for old, out in outs.items():
        said = runs[old].communicate(timeout=300)[0]
        assert out in said, said


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
# The stand-in target's verify refuses past this many positions (MESHD_FAULT_TARGET_REFUSE_AT): the long
# question (88 prompt tokens) passes its first verify (6 places) and is refused at its next, mid-answer; the
# short ones (71) never get there, the dsh turn (350) is refused at its first.
REFUSE_AT = 94
ASKS = {"greedy": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8},
        "seeded": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0.9,
                   "seed": 7, "logprobs": True, "top_logprobs": 2},
        "long": {"messages": [{"role": "user", "content": PROMPT * 2}], "max_tokens": 8}}


def ask(url: str, model, name: str) -> tuple:
    r = requests.post(f"{url}/chat/completions", timeout=300, json={**ASKS[name], **endless(model)})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return (choice["message"]["content"], r.json()["usage"]["completion_tokens"],
            [round(t["logprob"], 2) for t in (choice.get("logprobs") or {}).get("content", [])])


def metric(agents, name: str) -> list[str]:
    """Every rank's samples of `name` in its agent's /metrics, as 'labels value'."""
    text = "".join(a.get("/metrics").text for a in agents)
    return sorted(re.findall(rf"^{name}\{{([^}}]*)\}} ([0-9.]+)$", text, re.M))


def proxy_drafts(proxy: str) -> dict[tuple[str, str], float]:
    """meshd-proxy's draft counts, by (model, outcome)."""
    text = requests.get(proxy.removesuffix("/v1") + "/metrics", timeout=10).text
    return {(m, o): float(v) for m, o, v in re.findall(
        r'^meshd_proxy_draft_tokens_total\{model="([^"]*)",outcome="([^"]*)"\} ([0-9.]+)$', text, re.M)}


def drafts_asked(proxy: str, model) -> dict:
    """The greedy question with the mesh's drafts (whole), with none (whole) and with the mesh's streamed: each
    answer's body (the stream's text, lines and usage chunk), and the proxy's draft counts before and after."""
    body = {**ASKS["greedy"], **endless(model)}
    before = proxy_drafts(proxy)
    out = {name: requests.post(f"{proxy}/chat/completions", timeout=300, json={**body, **extra}).json()
           for name, extra in (("whole", {}), ("none", {"draft_tokens": 0}))}
    r = requests.post(f"{proxy}/chat/completions", timeout=300, stream=True,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}})
    lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    out["streamed"] = {"text": "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]),
                       "usage": chunks[-1]["usage"], "lines": lines}
    return {**out, "before": before, "after": proxy_drafts(proxy)}


@pytest.fixture(scope="module")
def served(dspark_model, tmp_path_factory):
    """One TP4 mesh under real agents, a controller and meshd-proxy: each question alone (drafted), a dsh
    turn, then the three questions at once while a lone request drafts (they join it once their prompts are in
    and all four are drafted row by row), then one alone again."""
    with omlx_mesh(tmp_path_factory.mktemp("mesh"), dspark_model, 4, {"MESHD_FAULT_TARGET_REFUSE_AT": str(REFUSE_AT)},
                   runtime={"model_package": "omlx", "args": {"prefill_step_size": 16}}) as (mesh, agents):
        proxy = json.loads(meshctl(mesh, "status", "--json").stdout)["urls"]["proxy"]

        def rank0():
            return agents[0].ranks()[-1]["status"]

        def idle() -> None:
            wait_for(lambda: rank0()["state"] == "ready", 60, "rank 0 idle again", interval=0.1)

        drafted = {name: ask(proxy, dspark_model, name) for name in ASKS}
        asked = drafts_asked(proxy, dspark_model)
        dsh = requests.post(f"{proxy}/chat/completions", timeout=300,
                            json={"messages": DSH_TURN, "tools": [WEATHER], "max_tokens": 4,
                                  "chat_template_kwargs": {"enable_thinking": True}})
        idle()
        alone = [a.ranks()[-1]["status"] for a in agents]
        metrics = {name: metric(agents, name) for name in (
            "meshd_agent_rank_draft_tokens_total", "meshd_agent_rank_draft_fallbacks_total",
            "meshd_agent_rank_draft_refeeds_total", "meshd_agent_rank_kernels_hidden")}
        # B>1 through the proxy: a lone request drafts; three arrive meanwhile, the proxy lets them all
        # through to rank 0, where the three join its batch; the lone one cancelled, the three go on drafted
        # row by row
        blocker = requests.post(f"{proxy}/chat/completions", stream=True, timeout=300,
                                json={**ASKS["greedy"], "max_tokens": 4000, "stream": True, **endless(dspark_model)})
        lines = blocker.iter_lines(decode_unicode=True)
        next(line for line in lines if line.startswith("data: "))
        with ThreadPoolExecutor(3) as pool:
            waiting = {name: pool.submit(ask, proxy, dspark_model, name) for name in ASKS}
            held = wait_for(lambda: (n := rank0()["requests_in_flight"]) == 4 and n, 120,
                            "rank 0 to hold the lone request and the three", interval=0.1)
            blocker.close()
            together = {name: f.result() for name, f in waiting.items()}
        idle()
        batched = rank0()
        again = requests.post(f"{proxy}/chat/completions", timeout=300, json={**ASKS["greedy"], "max_tokens": 4})
        idle()
        yield {"drafted": drafted, "asked": asked, "dsh": dsh, "alone": alone, "metrics": metrics, "held": held,
               "together": together, "batched": batched, "again": again, "after": rank0(),
               "logs": [(a.dir / "state" / "gen-1" / f"rank-{r}" / "rank.log").read_text()
                        for r, a in enumerate(agents)],
               "generation": json.loads(meshctl(mesh, "status", "--json").stdout)["generation"]}


def test_dspark_drafts_at_tp4_alone_and_row_by_row_and_the_answers_are_the_same_token_for_token(served):
    together = served["together"]
    assert served["drafted"] == together  # greedy, seeded (and its log probabilities), and the long one
    assert together["greedy"][1] == 8 and together["seeded"][2]
    first = served["alone"][0]
    assert first["drafter"] == "dspark" and 0 < first["draft_accepted"] <= first["draft_proposed"]
    counts = {(s["draft_proposed"], s["draft_accepted"], s["draft_fallbacks"]) for s in served["alone"]}
    assert len(counts) == 1  # every rank drafted and kept the same
    assert all("drafter armed: DSpark's 3 stages, blocks of 5 drafts" in log for log in served["logs"])


def test_a_request_asks_for_no_drafts_and_each_answers_usage_says_what_it_drafted_and_the_proxy_counts_it(served):
    asked = served["asked"]
    whole, none, streamed = asked["whole"], asked["none"], asked["streamed"]
    text = served["drafted"]["greedy"][0]
    assert whole["choices"][0]["message"]["content"] == none["choices"][0]["message"]["content"] == text
    assert streamed["text"] == text
    assert none["usage"]["draft_tokens"] == {"proposed": 0, "accepted": 0}
    assert none["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 0,
                                                         "rejected_prediction_tokens": 0}
    drafted = [whole["usage"]["draft_tokens"], streamed["usage"]["draft_tokens"]]
    assert all(0 < d["accepted"] <= d["proposed"] for d in drafted), drafted
    details = whole["usage"]["completion_tokens_details"]
    assert details["rejected_prediction_tokens"] == drafted[0]["proposed"] - drafted[0]["accepted"]
    assert not any(line.startswith(": usage") for line in streamed["lines"])  # rank 0's, for the proxy alone
    grew = {key: value - asked["before"].get(key, 0.0) for key, value in asked["after"].items()}
    assert grew == {(whole["model"], outcome): float(sum(d[outcome] for d in drafted))
                    for outcome in ("proposed", "accepted")}


def test_the_drafters_counts_reach_the_agents_metrics(served):
    proposed, accepted, fallbacks = (served["alone"][0][k] for k in ("draft_proposed", "draft_accepted",
                                                                      "draft_fallbacks"))
    samples = served["metrics"]["meshd_agent_rank_draft_tokens_total"]
    assert [v for labels, v in samples if 'kind="proposed"' in labels] == [f"{proposed:.1f}"] * 4
    assert [v for labels, v in samples if 'kind="accepted"' in labels] == [f"{accepted:.1f}"] * 4
    assert [v for _, v in served["metrics"]["meshd_agent_rank_draft_fallbacks_total"]] == [f"{fallbacks:.1f}"] * 4
    # this model's caches trim, so no verify fed its kept places again (omlx's V4, whose caches replay: pinned)
    assert [v for _, v in served["metrics"]["meshd_agent_rank_draft_refeeds_total"]] == ["0.0"] * 4


def test_more_than_one_request_through_the_proxy_is_drafted_row_by_row(served):
    assert served["held"] == 4  # the proxy admitted them at once: it knows this drafter batches
    before, batched, after = served["alone"][0], served["batched"], served["after"]
    lookups = lambda s: s["tape_hits"] + s["tape_misses"] + s["tape_not_reusable"]  # noqa: E731
    # the lone one and the three that joined it each looked the token tape up once
    assert lookups(batched) - lookups(before) == 4
    assert batched["draft_batched_steps"] > before["draft_batched_steps"] == 0  # drafted rows, one verify
    assert served["again"].status_code == 200, served["again"].text
    assert after["draft_proposed"] > batched["draft_proposed"] and lookups(after) == lookups(batched) + 1


def test_a_kernel_that_refuses_the_heads_per_rank_is_hidden_at_load_and_counted(served):
    assert all("kernel dspark_ring_gemm hidden: it refuses 2 heads per rank (ValueError: Unsupported DSpark "
               "physical-ring GEMM layout.)" in log for log in served["logs"])
    assert [s["kernels_hidden"] for s in served["alone"]] == [1] * 4
    assert [v for _, v in served["metrics"]["meshd_agent_rank_kernels_hidden"]] == ["1.0"] * 4


def test_a_refusal_in_the_targets_verify_falls_back_for_that_request_and_the_ranks_live(served):
    # the long prompt and the dsh turn, both past REFUSE_AT; their answers are the plain ones (the long one above)
    assert served["alone"][0]["draft_fallbacks"] == 2 and served["generation"] == 1  # no rank died
    assert "the target's verify refused (ValueError: Unsupported DSpark physical-ring GEMM layout." in served["logs"][0]


def test_a_dsh_turn_through_the_proxy_reaches_the_template_with_its_reasoning(served, dspark_model):
    assert served["dsh"].status_code == 200, served["dsh"].text
    said = load_tokenizer(dspark_model).apply_chat_template(
        DSH_TURN, tools=[WEATHER], add_generation_prompt=True, enable_thinking=True)
    assert served["dsh"].json()["usage"]["prompt_tokens"] == len(said)  # the reasoning and the call rendered


def test_stages_split_without_their_all_reduce_are_caught_by_the_digests(dspark_model, tmp_path):
    with start_mesh(dspark_model, 2, tmp_path, *OVERLAY,
                    env={**standin_env(), "MESHD_FAULT_DSPARK_UNREDUCED": "1"}) as mesh:
        mesh.wait_ready(300)  # the readiness answer is one token: no draft is verified yet
        r = requests.post(f"{mesh.url}/v1/chat/completions", timeout=300, json=ASKS["greedy"])
        assert r.status_code == 503 and r.json()["error"]["code"] == "generation_failed"
        assert mesh.wait_exit(timeout=120) == [1, 1]
        line = next(l for l in mesh.log(0).splitlines() if "[meshd] divergence" in l)
        assert classify(line).name == "divergence"
