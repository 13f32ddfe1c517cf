"""DeepSeek-V4 with its DSpark drafter through omlx's overlay, on a tiny checkpoint in DSpark's layout built
here (tests/kit/dspark.py) and omlx's entry points played by the stand-in in tests/standins/omlx: the
overlay set up before load by meshd's adapter, an omlx that lacks an entry point or stages that did not load
named at load; a DeepSeek Harness (dsh) turn, reasoning_content and tool calls, through DeepSeek's template."""

import os
import subprocess
import sys

import pytest

from kit.dspark import build_dspark_model, standin_env
from kit.ranks import start_mesh
from mlx_lm.chat_templates import deepseek_v32

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
