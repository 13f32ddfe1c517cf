"""Long prefills: which are said and when, their rate and first token expected (a clock injected), the words
a stream, `meshctl status` and the status page say them in; and each engine's prompts going in, chunk by
chunk, in process with the demo model."""

import pytest
from mlx_lm import load

from common.openai_api import SamplingParams
from common.prefills import EVERY, LONG_SECONDS, LONG_TOKENS, Position, Progress, Seen, Watch, due, long_prefills, \
    progress, words
from meshd.control.statuspage import prefills_section
from meshd.meshctl.progress import frame
from kit.drafters import drafting, undrafted
from runtime.engine.proposers import Head
from runtime.engine.jobs import Job
from runtime.models.demo_model import DemoModelSpec, build_demo_model

# (what the watch knew of it, its prompt's length, now), whether it is said now (every 1 s)
DUE = {
    "a long prompt at first sight": (Seen(10.0, 0), LONG_TOKENS, 10.0, True),
    "a long prompt whose cache held most of it": (Seen(10.0, 100), LONG_TOKENS + 99, 10.0, False),
    "a short one at first": (Seen(10.0, 0), 500, 10.5, False),
    "a short one going in for long": (Seen(10.0, 0), 500, 10.0 + LONG_SECONDS, True),
    "said less than a second ago": (Seen(10.0, 0, said=12.5), 9000, 13.4, False),
    "said a second ago": (Seen(10.0, 0, said=12.5), 9000, 13.5, True),
}


@pytest.mark.parametrize("seen,total,now,said", DUE.values(), ids=DUE.keys())
def test_when_a_prefill_is_said(seen, total, now, said):
    assert due(seen, total, now, EVERY) is said


# (first seen, at `now` where it is), its rate and seconds to its first token
RATES = {
    "not moved yet": (Seen(10.0, 0), Position("r", 0, 4096), 10.0, None, None),
    "from its first sight": (Seen(10.0, 512), Position("r", 2560, 4096), 12.0, 1024.0, 1.5),
    "its cached part not counted as rate": (Seen(10.0, 3000), Position("r", 3500, 4000), 11.0, 500.0, 1.0),
}


@pytest.mark.parametrize("seen,at,now,rate,eta", RATES.values(), ids=RATES.keys())
def test_a_prefills_rate_and_first_token_expected(seen, at, now, rate, eta):
    assert progress(seen, at, now) == Progress("r", at.done, at.total, rate, eta)


WORDS = {
    "at first": ((256, 4096, None, None), "256/4096 tokens"),
    "on its way": ((2048, 4096, 812.4, 2.52), "2048/4096 tokens, 812 tok/s, first token in ~2.5 s"),
    "minutes away": ((16384, 131072, 160.0, 717.0), "16384/131072 tokens, 160 tok/s, first token in ~12 min"),
}


@pytest.mark.parametrize("given,said", WORDS.values(), ids=WORDS.keys())
def test_the_words_a_prefill_is_said_in(given, said):
    assert words(*given) == said


def test_the_watch_says_long_prefills_at_its_pace_and_forgets_those_gone_in():
    watch = Watch(every=1.0)
    long, short = Position("long", 0, 8192), Position("short", 0, 300)
    said, going = watch.step([long, short], 100.0)
    assert said == going == [Progress("long", 0, 8192, None, None)]
    said, going = watch.step([Position("long", 512, 8192), Position("short", 100, 300)], 100.5)
    assert said == [] and [p.rid for p in going] == ["long"]
    said, going = watch.step([Position("long", 1024, 8192), Position("short", 200, 300)], 101.0)
    assert said == going == [Progress("long", 1024, 8192, 1024.0, 7.0), Progress("short", 200, 300, 200.0, 0.5)]
    said, going = watch.step([Position("long", 4096, 8192)], 102.0)  # short's first token came
    assert [p.rid for p in said] == ["long"]
    said, going = watch.step([Position("short", 0, 300)], 102.5)  # another request under the same id: anew
    assert said == going == []
    every_chunk = Watch(every=0.0)
    assert [len(every_chunk.step([Position("long", done, 8192)], 1.0 + done / 1e4)[0]) for done in (0, 16, 32)] \
        == [1, 1, 1]


def test_rank_0s_long_prefills_as_meshctl_status_and_the_status_page_show_them():
    shown = Progress("chatcmpl-0123456789abcdef", 2048, 4096, 812.44, 2.521).shown()
    assert shown == {"rid": "chatcmpl-0123456", "done": 2048, "total": 4096, "rate": 812.4, "eta": 2.5}
    status = {"generation": 3, "phase": "ready", "nodes": [
        {"node": "n1", "rank": {"rank": 1, "status": {"prefills": [shown]}}},  # the same prompts as rank 0's
        {"node": "n0", "rank": {"rank": 0, "status": {"prefills": [shown]}}},
        {"node": "n2", "rank": None}]}
    line = "prefill chatcmpl-0123456 on n0 rank 0: 2048/4096 tokens, 812 tok/s, first token in ~2.5 s"
    assert long_prefills(status) == [line]
    assert frame(status, 0.0)[-1] == f"  {line}"
    assert f"<li>{line}</li>" in prefills_section(status)
    assert prefills_section({**status, "nodes": status["nodes"][2:]}) == ""


SAMPLING = {**SamplingParams(max_tokens=1).sampling(), "temperature": 0.0}


@pytest.fixture(scope="module")
def demo(demo_model):
    model, tokenizer = load(str(demo_model))
    return model, set(tokenizer.eos_token_ids)


def goes_in(engine, jobs: list[Job]) -> list[list[tuple[str, int, int]]]:
    """The prompts going in after each step, until the engine is done."""
    for job in jobs:
        engine.insert(job)
    seen = []
    while engine.busy:
        engine.step()
        seen.append([(p.rid, p.done, p.total) for p in engine.prefilling()])
    return seen


def test_rows_go_in_a_chunk_a_step_each_behind_the_one_before_and_a_cached_prompt_starts_at_its_cached_part(demo):
    engine = undrafted(*demo, prefill_step_size=16)
    first = Job("a", tuple(range(5, 45)), 2, 0, SAMPLING)
    goes_in(engine, [first])  # its tape now holds the first prompt and its answer
    seen = goes_in(engine, [Job("b", (*first.prompt, *range(100, 120)), 2, 0, SAMPLING),
                            Job("c", tuple(range(7, 30)), 2, 0, SAMPLING)])
    assert seen[:4] == [[("b", 56, 60), ("c", 0, 23)], [("c", 0, 23)], [("c", 16, 23)], []]


@pytest.fixture(scope="module")
def mtp_demo(tmp_path_factory):
    path = build_demo_model(tmp_path_factory.mktemp("models") / "mtp", DemoModelSpec(mtp=True, mtp_train_steps=1))
    model, _ = load(str(path))
    return model


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "drafted"])
def test_a_request_goes_in_a_chunk_a_step_its_last_with_its_first_token(demo, mtp_demo, drafted):
    engine = drafting(mtp_demo, set(), Head(mtp_demo), prefill_step_size=16) if drafted else \
        undrafted(*demo, prefill_step_size=16)
    seen = goes_in(engine, [Job("a", tuple(range(5, 55)), 2, 0, SAMPLING)])
    assert seen[:4] == [[("a", 16, 50)], [("a", 32, 50)], [("a", 48, 50)], []]
