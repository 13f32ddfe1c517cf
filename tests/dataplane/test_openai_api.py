"""Table tests for request validation and the stop-string helpers."""

import pytest

from common import openai_api as oa
from common.grammars import DSML, Builder, ToolFormat
from kit.openai import validate

LIMITS = oa.Limits("demo", default_max_tokens=64, max_tokens_limit=1000, aliases=("/models/demo", "org/demo-1b"))
MSG = [{"role": "user", "content": "hi"}]

GOOD = [
    ("defaults", {"messages": MSG}, dict(max_tokens=64, temperature=0.0, top_p=1.0, seed=None, stop=())),
    ("all params", {"messages": MSG, "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 9, "stop": "x"},
     dict(max_tokens=5, temperature=0.7, top_p=0.9, seed=9, stop=("x",))),
    ("max_completion_tokens", {"messages": MSG, "max_completion_tokens": 7}, dict(max_tokens=7)),
    ("null temperature is default", {"messages": MSG, "temperature": None}, dict(temperature=0.0)),
    ("stop list", {"messages": MSG, "stop": ["a", "b"]}, dict(stop=("a", "b"))),
    ("default model alias", {"model": "default", "messages": MSG}, dict()),
    ("model by its path", {"model": "/models/demo", "messages": MSG}, dict()),
    ("model by a hub id", {"model": "org/demo-1b", "messages": MSG}, dict()),
    ("sampling knobs", {"messages": MSG, "top_k": 1, "min_p": 0.1, "presence_penalty": 0.5,
                        "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"7": -100, "3": 5}},
     dict(top_k=1, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
          logit_bias=((3, 5.0), (7, -100.0)))),
    ("harmless fields", {"messages": MSG, "user": "u1", "metadata": {"a": "b"}, "store": False}, dict()),
    ("plain text format, no tools", {"messages": MSG, "response_format": {"type": "text"}, "tool_choice": "none"},
     dict()),
    ("no max_tokens: the server's default, said so", {"messages": MSG}, dict(max_tokens=64, named=False)),
    ("no draft_tokens: the mesh's width", {"messages": MSG, "draft_tokens": None}, dict(draft_tokens=None)),
    ("no drafts", {"messages": MSG, "draft_tokens": 0}, dict(draft_tokens=0)),
    ("fewer drafts", {"messages": MSG, "draft_tokens": 2}, dict(draft_tokens=2)),
]


@pytest.mark.parametrize("name,body,expect", GOOD, ids=[g[0] for g in GOOD])
def test_valid_chat_requests(name, body, expect):
    req = oa.parse_request("chat", body, LIMITS)
    assert req.model == "demo"
    for k, v in expect.items():
        assert getattr(req.params, k) == v


def test_text_parts_are_joined():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert oa.parse_request("chat", body, LIMITS).messages[0]["content"] == "ab"


BAD = [
    ("not an object", "chat", [], 400, None),
    ("n above the most choices", "chat", {"messages": MSG, "n": oa.MAX_CHOICES + 1}, 400, "n"),
    ("n of none", "chat", {"messages": MSG, "n": 0}, 400, "n"),
    ("stream not bool", "chat", {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("seed float", "chat", {"messages": MSG, "seed": 1.5}, 400, "seed"),
    ("too many stops", "chat", {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("empty stop", "chat", {"messages": MSG, "stop": [""]}, 400, "stop"),
    ("bool max_tokens", "chat", {"messages": MSG, "max_tokens": True}, 400, "max_tokens"),
    ("negative temperature", "chat", {"messages": MSG, "temperature": -1}, 400, "temperature"),
    ("message not object", "chat", {"messages": ["hi"]}, 400, "messages[0]"),
    ("image part", "chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]"),
    ("model wrong type", "chat", {"model": 3, "messages": MSG}, 400, "model"),
    ("unknown model", "text", {"model": "other", "prompt": "x"}, 404, "model"),
    ("prompt list of two", "text", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("stream_options wrong type", "text", {"prompt": "x", "stream_options": 1}, 400, "stream_options"),
    ("draft_tokens above the most", "chat", {"messages": MSG, "draft_tokens": oa.MAX_DRAFT_TOKENS + 1}, 400,
     "draft_tokens"),
    ("negative draft_tokens", "text", {"prompt": "x", "draft_tokens": -1}, 400, "draft_tokens"),
    ("draft_tokens not an integer", "text", {"prompt": "x", "draft_tokens": 1.5}, 400, "draft_tokens"),
    ("draft_tokens true", "chat", {"messages": MSG, "draft_tokens": True}, 400, "draft_tokens"),
]


@pytest.mark.parametrize("name,kind,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_invalid_requests_name_the_field(name, kind, body, status, param):
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request(kind, body, LIMITS)
    assert e.value.status == status
    assert e.value.param == param
    validate(e.value.body(), "ErrorResponse")


STOPS = [
    ("no stop", "hello", ("zz",), -1, 0),
    ("stop inside", "hello world", ("o w",), 4, 0),
    ("earliest of two", "abcdef", ("de", "bc"), 1, 0),
    ("partial at the end is held back", "hello wo", ("world",), -1, 2),
    ("longest partial wins", "xab", ("abc", "bzz"), -1, 2),
]


@pytest.mark.parametrize("name,text,stops,cut,held", STOPS, ids=[s[0] for s in STOPS])
def test_stop_strings(name, text, stops, cut, held):
    assert oa.find_stop(text, stops) == cut
    assert oa.held_back(text, stops) == held


# (prompt, resumed, generated, cached by the engine) -> (prompt_tokens, completion_tokens, cached)
USAGE = [
    ("fresh, nothing cached", (119, 0, 30, 0), (119, 30, 0)),
    ("fresh, a prefix cached", (119, 0, 30, 100), (119, 30, 100)),
    ("resumed, prompt and answer so far cached", (119, 139, 20, 258), (119, 159, 119)),
    ("resumed, part of the prompt cached", (119, 139, 20, 50), (119, 159, 50)),
    ("resumed cold", (119, 139, 20, 0), (119, 159, 0)),
    ("resumed with every token sent: only the end was lost", (119, 30, 0, 0), (119, 30, 0)),
]


@pytest.mark.parametrize("name,given,seen", USAGE, ids=[u[0] for u in USAGE])
def test_usage_counts_the_answer_so_far_once_and_never_caches_more_than_the_prompt(name, given, seen):
    u = oa.usage(*given)
    assert (u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"]) == seen
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    # DeepSeek's words for the same: the prompt's tokens the cache served, and the rest
    assert (u["prompt_cache_hit_tokens"], u["prompt_cache_miss_tokens"]) == (seen[2], seen[0] - seen[2])


def test_the_usage_of_several_answers_counts_the_prompt_once_and_every_answers_tokens():
    rows = [oa.usage(100, 0, 7, 100), oa.usage(100, 0, 5, 60), oa.usage(100, 0, 9, 80)]
    u = oa.summed_usage(rows)
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (100, 21, 121)
    assert (u["prompt_tokens_details"]["cached_tokens"], u["prompt_cache_hit_tokens"],
            u["prompt_cache_miss_tokens"]) == (60, 60, 40)


def test_a_bad_draft_tokens_says_the_range():
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request("chat", {"messages": MSG, "draft_tokens": "3"}, LIMITS)
    assert e.value.message == "'draft_tokens' must be an integer between 0 and 64, got '3'"


# (drafts as (proposed, accepted) of each answer) -> OpenAI's accepted and rejected predictions, meshd's draft_tokens
DRAFTED = [
    ("an undrafted mesh's answer", [None], None),
    ("one drafted answer", [(12, 9)], (9, 3, {"proposed": 12, "accepted": 9})),
    ("asked for none on a drafted mesh", [(0, 0)], (0, 0, {"proposed": 0, "accepted": 0})),
    ("several answers: their sum", [(12, 9), (0, 0), (5, 1)], (10, 7, {"proposed": 17, "accepted": 10})),
]


@pytest.mark.parametrize("name,drafts,seen", DRAFTED, ids=[d[0] for d in DRAFTED])
def test_usage_says_what_the_answers_drafted_and_accepted(name, drafts, seen):
    rows = [oa.usage(100, 0, 20, 0, d) for d in drafts]
    u = rows[0] if len(rows) == 1 else oa.summed_usage(rows)
    if seen is None:
        assert "draft_tokens" not in u and "completion_tokens_details" not in u
        return
    details = u["completion_tokens_details"]
    assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"], u["draft_tokens"]) == seen
    assert u["completion_tokens"] == 20 * len(rows)


def test_bodies_validate_against_the_official_schemas():
    req = oa.parse_request("chat", {"messages": MSG}, LIMITS)
    u = oa.usage(3, 0, 4, 1, (6, 2))
    validate(oa.completion_body(req, "id", 1, "x", "stop", u), "CreateChatCompletionResponse")
    validate(oa.chunk_body(req, "id", 1, "x", None, first=True), "CreateChatCompletionStreamResponse")
    validate(oa.chunk_body(req, "id", 1, None, "length"), "CreateChatCompletionStreamResponse")
    validate(oa.usage_chunk(req, "id", 1, u), "CreateChatCompletionStreamResponse")
    text = oa.parse_request("text", {"prompt": "p"}, LIMITS)
    validate(oa.completion_body(text, "id", 1, "x", "length", u), "CreateCompletionResponse")
    validate(oa.chunk_body(text, "id", 1, "x", "length"), "CreateCompletionResponse")
    validate(oa.models_body("demo", 1), "ListModelsResponse")


def test_text_stream_chunks_differ_from_the_schema_only_by_a_null_finish_reason():
    """Legacy completions have no stream schema; OpenAI sends `finish_reason:
    null` on all but the last chunk, which CreateCompletionResponse does not
    allow. We send what OpenAI sends."""
    text = oa.parse_request("text", {"prompt": "p"}, LIMITS)
    chunk = oa.chunk_body(text, "id", 1, "x", None)
    assert chunk["choices"][0]["finish_reason"] is None
    chunk["choices"][0]["finish_reason"] = "stop"
    validate(chunk, "CreateCompletionResponse")
    validate(oa.models_body("demo", 1), "ListModelsResponse")


@pytest.mark.parametrize("field,value", [("logprobs", 3),
                                         ("functions", []), ("frobnicate", 1), ("meshd", {"ids": True})])
def test_a_field_this_server_does_not_honour_is_refused_by_name_never_dropped(field, value):
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request("chat", {"messages": MSG, field: value}, LIMITS)
    assert (e.value.status, e.value.param) == (400, field)
    assert e.value.code in ("unsupported_parameter", "invalid_value")


# DeepSeek's request fields, as DeepSeek means them: (fields) -> the chat template's arguments
DEEPSEEK = [
    ("absent: the model's default", {}, {}),
    ("thinking null: the model's default", {"thinking": None}, {}),
    ("thinking enabled", {"thinking": {"type": "enabled"}}, {"enable_thinking": True}),
    ("thinking disabled", {"thinking": {"type": "disabled"}}, {"enable_thinking": False}),
    ("the template's own switch agrees", {"thinking": {"type": "disabled"},
                                          "chat_template_kwargs": {"enable_thinking": False}},
     {"enable_thinking": False}),
    ("effort high", {"reasoning_effort": "high"}, {"reasoning_effort": "high"}),
    ("effort medium is high", {"reasoning_effort": "medium"}, {"reasoning_effort": "high"}),
    ("effort minimal is low", {"reasoning_effort": "minimal"}, {"reasoning_effort": "low"}),
    ("effort xhigh is max", {"thinking": {"type": "enabled"}, "reasoning_effort": "xhigh"},
     {"enable_thinking": True, "reasoning_effort": "max"}),
    ("no effort while thinking is off", {"thinking": {"type": "disabled"}, "reasoning_effort": "max"},
     {"enable_thinking": False}),
    ("effort null", {"reasoning_effort": None}, {}),
]


@pytest.mark.parametrize("name,fields,kwargs", DEEPSEEK, ids=[d[0] for d in DEEPSEEK])
def test_deepseeks_thinking_switch_and_effort_reach_the_chat_template(name, fields, kwargs):
    req = oa.parse_request("chat", {"messages": MSG, **fields}, LIMITS)
    assert req.template_kwargs == kwargs
    assert req.thinking_off == (kwargs.get("enable_thinking") is False)


@pytest.mark.parametrize("fields,param,says", [
    ({"thinking": {"type": "auto"}}, "thinking", '{"type": "enabled"}'),
    ({"thinking": "disabled"}, "thinking", '{"type": "disabled"}'),
    ({"thinking": {"type": "enabled"}, "chat_template_kwargs": {"enable_thinking": False}}, "thinking",
     "send one of them"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "minimal, low, medium, high, xhigh, max"),
])
def test_deepseek_fields_that_mean_nothing_are_400s_naming_them(fields, param, says):
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request("chat", {"messages": MSG, **fields}, LIMITS)
    assert (e.value.status, e.value.param) == (400, param) and says in e.value.message, e.value.message


@pytest.mark.parametrize("choice,offered", [(None, True), ("auto", True), ("none", False)],
                         ids=["null: the default", "auto", "none"])
def test_a_null_tool_choice_is_the_default_with_tools_and_without(choice, offered):
    assert oa.parse_request("chat", {"messages": MSG, "tools": [WEATHER], "tool_choice": choice},
                            LIMITS).tools == ((WEATHER,) if offered else ())
    assert oa.parse_request("chat", {"messages": MSG, "tools": None, "tool_choice": choice}, LIMITS).tools == ()


def test_several_answers_are_rows_each_with_a_seed_of_its_own():
    req = oa.parse_request("chat", {"messages": MSG, "n": 3, "seed": 7}, LIMITS)
    assert req.n == 3 and req.params.seed == 7
    seeds = [oa.row_seed(7, i) for i in range(3)]
    assert seeds[0] == 7 and len(set(seeds)) == 3 and all(0 <= s < 2**63 for s in seeds)
    with pytest.raises(oa.ApiError) as e:  # a resumed answer is one answer
        oa.parse_request("chat", {"messages": MSG, "n": 2, "meshd": {"resume": {
            "ids": [1], "chars": 1, "id": "x", "created": 1, "seed": 1}}}, LIMITS, internal=True)
    assert e.value.param == "meshd"


def test_the_proxys_meshd_object_goes_and_comes_back_typed():
    internal = oa.Internal(True, oa.Resume((1, 2), 3, "chatcmpl-x", 5, 6), "t1")
    assert oa.parse_request("chat", {"messages": MSG, "meshd": internal.wire()}, LIMITS, internal=True).internal \
        == internal
    assert oa.Internal().wire() == {}
    with pytest.raises(oa.ApiError) as e:
        oa.Internal.from_wire({"resume": {"ids": [1]}})
    assert (e.value.status, e.value.param) == (400, "meshd")


TURN = [{"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


@pytest.mark.parametrize("messages,refused", [
    (TURN, "messages[1].reasoning_content"),
    ([TURN[0], {**TURN[1], "reasoning_content": "I look it up."}, TURN[2]], None),
    ([TURN[0], {**TURN[1], "reasoning_content": ""}, TURN[2]], None),  # passed back, though empty
    (TURN + [{"role": "user", "content": "and tomorrow?"}], None),  # a new user turn: the old reasoning is not needed
    (MSG, None),
], ids=["a tool turn without its reasoning", "with it", "with it empty", "before the last user turn", "no tools"])
def test_a_tool_turn_in_thinking_mode_carries_its_reasoning_back_or_gets_deepseeks_400(messages, refused):
    e = oa.missing_reasoning(oa.parse_request("chat", {"messages": messages}, LIMITS))
    assert (e and e.param) == refused
    if e:
        assert (e.status, e.type) == (400, "invalid_request_error")
        assert e.message.startswith("The reasoning_content in the thinking mode must be passed back to the API")
        validate(e.body(), "ErrorResponse")


DSML_CUT = ('\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>'
            '\n<｜DSML｜parameter name="days" string="false">12')


@pytest.mark.parametrize("block,calls", [
    ('\n{"name": "get_weather", "arguments": {"city": "Os', [("get_weather", '{"city": "Os')]),
    ('\n{"name": "get_weather", "arguments": {"days": 1234', [("get_weather", '{"days": 1234')]),
    ('\n{"name": "get_wea', []),  # not even its name
    (DSML_CUT, [("get_weather", '{"city": "Oslo", "days": 12')]),
    ('\n<｜DSML｜invoke name="a">\n<｜DSML｜parameter name="q" string="true">x"y</｜DSML｜parameter>\n</｜DSML｜invoke>'
     '\n<｜DSML｜invoke name="b">\n<｜DSML｜parameter name="q" string="true">ab', [("a", '{"q": "x\\"y"}'),
                                                                                  ("b", '{"q": "ab')]),
], ids=["json_tools in a string", "json_tools in an integer", "json_tools before its name", "DSML",
        "DSML, one whole and one cut"])
def test_a_call_cut_by_max_tokens_is_returned_as_far_as_it_was_written(block, calls):
    got = oa.partial_calls(block)
    assert [(c["name"], c["arguments"]) for c in got] == calls
    for call in got:
        body = oa.tool_call_body(call, 0)
        assert body["function"]["arguments"] == call["arguments"]
        validate({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
            {"index": 0, "delta": {"tool_calls": [body]}, "logprobs": None, "finish_reason": "length"}]},
                 "CreateChatCompletionStreamResponse")


@pytest.mark.parametrize("field,value", [("top_k", 1.5), ("top_k", -1), ("min_p", 2), ("logit_bias", {"x": 1}),
                                         ("logit_bias", {"5": 101}), ("repetition_penalty", 0),
                                         ("top_logprobs", 21)])
def test_sampling_knobs_out_of_range_are_400(field, value):
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request("chat", {"messages": MSG, field: value}, LIMITS)
    assert (e.value.status, e.value.param) == (400, field)


def test_without_max_tokens_the_answer_may_run_to_the_limit_when_no_default_is_set():
    open_ended = oa.Limits("demo", default_max_tokens=0, max_tokens_limit=1000)
    assert oa.parse_request("chat", {"messages": MSG}, open_ended).params.max_tokens == 1000


def test_models_lists_every_name_the_model_answers_to():
    body = oa.models_body("demo", 1, LIMITS.aliases)
    assert [m["id"] for m in body["data"]] == ["demo", "/models/demo", "org/demo-1b"]
    validate(body, "ListModelsResponse")


THINK = oa.Thinking("<think>", "</think>")


@pytest.mark.parametrize("text,thinking,reasoning_first,regions", [
    ("abc", None, False, (0, 0, 0)),                                  # a model that does not think
    ("abc", THINK, True, (0, 3, 3)),                                  # still thinking: all reasoning so far
    ("abc</think>\n\nxyz", THINK, True, (0, 3, 13)),                  # closed: content after the whitespace
    ("\n<think>ab</think>x", THINK, False, (8, 10, 18)),              # it opened the block itself
    ("hello <think>ab</think>", THINK, False, (0, 0, 0)),             # a think tag inside the answer is text
    ("ab</think>", THINK, True, (0, 2, 10)),                           # closed, no content yet
])
def test_answer_regions_split_reasoning_from_content(text, thinking, reasoning_first, regions):
    assert oa.answer_regions(text, thinking, reasoning_first) == regions


def test_chat_template_kwargs_reach_the_request_or_are_refused_by_name():
    assert oa.parse_request("chat", {"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}},
                            LIMITS).template_kwargs == {"enable_thinking": False}
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request("chat", {"messages": MSG, "chat_template_kwargs": ["enable_thinking"]}, LIMITS)
    assert (e.value.status, e.value.param) == (400, "chat_template_kwargs")
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request("text", {"prompt": "p", "chat_template_kwargs": {}}, LIMITS)
    assert (e.value.status, e.value.param) == (400, "chat_template_kwargs")


WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("fields,param,says", [
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0]", "letters, digits"),
    ({"tools": "get_weather"}, "tools", "must be a list"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not among 'tools'"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice", "no 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", '"none", "auto"'),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
])
def test_tools_that_cannot_be_honoured_are_400s_that_say_why(fields, param, says):
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request("chat", {"messages": MSG, **fields}, LIMITS)
    assert (e.value.status, e.value.param) == (400, param) and says in e.value.message


def test_tools_reach_the_request_and_a_history_of_calls_reaches_the_template_as_sent():
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    req = oa.parse_request("chat", {"messages": history, "tools": [WEATHER]}, LIMITS)
    assert req.tools == (WEATHER,)
    assert req.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert req.messages[1]["content"] == "" and req.messages[2]["tool_call_id"] == "c1"
    assert oa.parse_request("chat", {"messages": MSG, "tools": [WEATHER], "tool_choice": "none"}, LIMITS).tools == ()


STRICT = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"],
          "additionalProperties": False}


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": STRICT, "strict": True}}},
    {"tools": [WEATHER], "tool_choice": "required"},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
], ids=["json_object", "json_schema", "required call", "named call"])
def test_structured_output_travels_as_a_grammar_in_the_sampling_settings(fields):
    req = oa.parse_request("chat", {"messages": MSG, **fields}, LIMITS)
    assert req.params.grammar and req.params.sampling()["grammar"] == req.params.grammar
    assert oa.parse_request("chat", {"messages": MSG}, LIMITS).params.sampling()["grammar"] is None


@pytest.mark.parametrize("fields,param,says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}}},
     "response_format.json_schema.schema", '"if"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}}},
     "response_format.json_schema.schema", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": STRICT}}}, "response_format.json_schema",
     "'name'"),
    ({"response_format": {"type": "yaml"}}, "response_format", '"json_object"'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}],
      "tool_choice": "required"}, "tool_choice", '"if"'),
])
def test_structured_output_that_cannot_be_held_is_a_400_naming_the_part(fields, param, says):
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request("chat", {"messages": MSG, **fields}, LIMITS)
    assert (e.value.status, e.value.param) == (400, param) and says in e.value.message, e.value.message


def test_completions_take_no_response_format():
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request("text", {"prompt": "a", "response_format": {"type": "json_object"}}, LIMITS)
    assert (e.value.status, e.value.param, e.value.code) == (400, "response_format", "unsupported_parameter")


FORCED = {"messages": MSG, "tools": [WEATHER], "tool_choice": "required"}


@pytest.mark.parametrize("tools,says", [
    (None, "this model has no tool calling"),
    (ToolFormat('"[TOOL_CALLS]"', '"[/TOOL_CALLS]"', "mistral", ""), "writes calls in the mistral format"),
], ids=["no tool calling", "a format no grammar writes"])
def test_a_forced_call_the_readers_model_cannot_write_is_a_400_naming_why(tools, says):
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request("chat", FORCED, LIMITS, grammars=Builder(tools))
    assert (e.value.status, e.value.param) == (400, "tool_choice") and says in e.value.message, e.value.message


def test_the_readers_builder_writes_the_grammar_and_checks_it():
    checked = []
    dsml = Builder(ToolFormat(f'"<{DSML}tool_calls>"', f'"</{DSML}tool_calls>"', "deepseek_v32", "dsml"),
                   lambda text: checked.append(text) or text)
    req = oa.parse_request("chat", FORCED, LIMITS, grammars=dsml)
    assert checked == [req.params.grammar] and f'<{DSML}invoke name=\\"get_weather\\">' in req.params.grammar
    assert "<tool_call>" in oa.parse_request("chat", FORCED, LIMITS).params.grammar  # the proxy's stand-in


@pytest.mark.parametrize("text,begin,spans,open_at", [
    ("plain answer", 0, [], None),
    ("a<tool_call>x</tool_call>b", 0, [(1, 25)], None),
    ("<tool_call>x</tool_call><tool_call>y", 0, [(0, 24)], 24),
    ("<tool_call>x</tool_call>", 1, [], None),  # before the content: not a call
])
def test_tool_spans(text, begin, spans, open_at):
    assert oa.tool_spans(text, "<tool_call>", "</tool_call>", begin) == (spans, open_at)


@pytest.mark.parametrize("spans,lo,hi,gaps", [
    ([], 0, 5, [(0, 5)]),
    ([(1, 3)], 0, 5, [(0, 1), (3, 5)]),
    ([(0, 2), (2, 4)], 0, 4, []),
    ([(1, 3)], 2, 2, []),
    ([(4, 9)], 0, 6, [(0, 4)]),
])
def test_outside(spans, lo, hi, gaps):
    assert oa.outside(spans, lo, hi) == gaps
