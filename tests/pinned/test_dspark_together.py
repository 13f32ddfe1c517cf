"""Every request drafted, however many run, on omlx's REAL DeepSeek-V4 (the tiny checkpoint of pinned.dsv4, its
compressed layers' pooled caches), in this process and at TP2 on the ring (real meshd-rank processes over
loopback): every request is drafted row by row (runtime/engine/rowwise.py), a lone one as a batch of one in its
own caches, each row from its own committed taps, each keeping its own count and its caches going back exactly;
a request sent during a drafted answer joins it once its prompt is in, the drafted answer going on, on both
ranks; rows join and leave mid-answer; a request asking for fewer drafts or none keeps to them, its usage saying
what it drafted; every answer is plain decoding's, token for token, greedy and seeded.

Run: .venv-omlx/bin/python -m pytest tests/pinned/test_dspark_together.py"""

import threading
from dataclasses import replace

import pytest
import requests
from mlx_lm.utils import load_tokenizer

from common.openai_api import SamplingParams
from kit.demo_answers import endless
from kit.ranks import start_mesh
from kit.waiting import wait_for
from pinned.dsv4 import OVERLAY, PROMPT, greedy, pinned_env
from runtime.engine import rowwise
from kit.drafters import undrafted
from runtime.engine.jobs import Job
from runtime.engine.proposers import Stages
from runtime.engine.rowwise import RowwiseEngine
from runtime.prefix.store import PrefixStore

LONG = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 256, "temperature": 0}
SHORT = {"messages": [{"role": "user", "content": "And the pooled keys?"}], "max_tokens": 12, "temperature": 0.9,
         "seed": 7}
SENT_AT = 16  # tokens of the drafted answer the client has when it sends the second request


def stream_ids(url: str, body: dict, ids: list[int], went: threading.Event | None = None) -> None:
    """The body's answer streamed from rank 0, each chunk's token ids (meshd's `ids` comments) appended to
    `ids`; `went` set once SENT_AT of them came."""
    r = requests.post(f"{url}/v1/chat/completions", stream=True, timeout=600,
                      json={**body, "stream": True, "meshd": {"ids": True}})
    assert r.status_code == 200, r.text
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith(": ids "):
            ids += [int(t) for t in line.split(" ")[3].split(",") if t]
            if went is not None and len(ids) >= SENT_AT:
                went.set()


def plain(model, prompt: list[int], body: dict, bias: dict) -> list[int]:
    """Plain decoding's answer to `body` (its prompt's ids `prompt`) on one rank, in this process."""
    sampling = SamplingParams(max_tokens=1, temperature=body["temperature"], seed=body.get("seed"),
                              logit_bias=tuple((int(t), float(b)) for t, b in bias.items())).sampling()
    engine = undrafted(model, set(), prefill_step_size=128)
    engine.insert(Job("p", tuple(prompt), body["max_tokens"], body.get("seed", 0), sampling))
    tokens = []
    while engine.busy:
        tokens += [e.token for e in engine.step() if e.token is not None]
    return tokens


GREEDY = SamplingParams(max_tokens=1).sampling()
SEEDED = SamplingParams(max_tokens=1, temperature=0.9, seed=7).sampling()
A = tuple(range(60, 150))  # past the ratio-4 layers' index_topk * 4: their sparse path
B = tuple(range(300, 320))


def decoded(engine, *jobs: tuple[Job, int], drafts: dict | None = None) -> dict[str, list[int]]:
    """Each job's tokens, each inserted after its given count of the engine's steps; each step's drafts of each
    (proposed, accepted) appended to `drafts`, when given."""
    said, steps = {job.rid: [] for job, _ in jobs}, 0
    while steps <= max(at for _, at in jobs) or engine.busy:
        for job, at in jobs:
            if at == steps:
                engine.insert(job)
        for e in engine.step():
            said[e.rid] += [e.token] if e.token is not None else []
            if drafts is not None and e.drafts is not None:
                drafts.setdefault(e.rid, []).append(e.drafts)
        steps += 1
    return said


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_joining_a_lone_drafted_answer_in_its_prompt_at_its_first_token_or_mid_way_both_plain_decoding(
        model, sampling):
    a, b = Job("a", A, 40, 3, sampling), Job("b", B, 12, 4, sampling)
    plain = {job.rid: decoded(undrafted(model, set(), prefill_step_size=32), (job, 0))[job.rid] for job in (a, b)}
    engine = RowwiseEngine(model, set(), Stages(model), prefixes=PrefixStore(model, prefill_step_size=32), prefill_step_size=32,
                           log=lambda m: m)
    alone = []  # each verify: whether its one row decoded in its own caches
    verify = engine._verify
    engine._verify = lambda width: alone.append(len(engine._rows) == 1 and not engine._merged) or verify(width)
    for at in (1, 3, 9):  # b comes in a's prompt (90 tokens, 32 a step), at a's first verify, mid-way
        assert decoded(engine, (a, 0), (b, at)) == plain
    assert any(alone) and not all(alone) and engine.batched_steps > 0  # alone in its own caches, then merged


ROWS = (Job("a", A, 40, 3, GREEDY), Job("b", B, 12, 4, GREEDY), Job("c", tuple(range(200, 237)), 30, 5, GREEDY),
        Job("d", tuple(range(10, 17)), 25, 6, GREEDY))
COMING = (0, 2, 5, 11)  # the step each row comes at: b, c and d join mid-answer, b and d leave before a ends


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_rows_drafted_together_joining_and_leaving_mid_answer_each_answer_plain_decoding(model, sampling):
    jobs = [replace(job, sampling=sampling) for job in ROWS]
    plain = {job.rid: decoded(undrafted(model, set(), prefill_step_size=32), (job, 0))[job.rid] for job in jobs}
    rows = RowwiseEngine(model, set(), Stages(model), prefixes=PrefixStore(model, prefill_step_size=32), prefill_step_size=32,
                         log=lambda m: m)
    assert decoded(rows, *zip(jobs, COMING)) == plain
    assert rows.width == 5 and rows.batched_steps > 10 and rows.fallbacks == 0  # the block: windows pooled alone
    if sampling is GREEDY:
        assert rows.accepted > rows.proposed / 3  # the stages' drafts, kept; seeded ones miss at temperature 0.9


def test_requests_that_ask_for_fewer_drafts_or_none_get_them_alone_joined_and_row_by_row_and_answer_plainly(
        model):
    """draft_tokens below the engine's 5 a row (0: none): a request alone, then joined by another, and rows of
    the batch each keep to their own; every answer is plain decoding's and each step says what it proposed and
    how many of those the answer kept."""
    jobs = [replace(job, draft_tokens=asked) for job, asked in zip(ROWS, (None, 1, 0, 2))]
    widths = {"a": 5, "b": 1, "c": 0, "d": 2}
    plain = {job.rid: decoded(undrafted(model, set(), prefill_step_size=32), (job, 0))[job.rid] for job in jobs}
    prefixes = PrefixStore(model, prefill_step_size=32)
    for coming in ([(jobs[1], 0), (jobs[2], 4)], list(zip(jobs, COMING))):
        engine = RowwiseEngine(model, set(), Stages(model), prefixes=prefixes, prefill_step_size=32, log=lambda m: m)
        drafts = {}
        assert decoded(engine, *coming, drafts=drafts) == {job.rid: plain[job.rid] for job, _ in coming}
        for rid, steps in drafts.items():
            assert all(accepted <= proposed <= widths[rid] for proposed, accepted in steps), (rid, steps)
            assert (sum(p for p, _ in steps) > 0) == (widths[rid] > 0), (rid, steps)


ALIKE = (Job("e", tuple(range(400, 470)), 20, 7, GREEDY), Job("f", tuple(range(330, 400)), 16, 8, GREEDY),
         Job("g", tuple(range(150, 195)), 18, 9, GREEDY), Job("h", tuple(range(20, 90)), 24, 10, GREEDY))  # vocab 512


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("asked", [None, 0], ids=["drafted", "undrafted"])
def test_prompts_at_one_place_go_in_together_and_each_answer_and_next_turn_is_plain_decodings(model, sampling, asked):
    """Requests sent at once, three of one length and one shorter: each piece of the three goes in in one forward
    (their caches merged for it and taken back out), the shorter one's apart where its piece differs; every
    answer, drafted or not, is plain decoding's, and a next turn finds the whole first one in the token tape
    and answers as the plain decoder does from its own. The model answers from its caches: a wrong one changes
    the answer."""
    jobs = [replace(job, sampling=sampling, draft_tokens=asked) for job in ALIKE]
    plain = {job.rid: decoded(undrafted(model, set(), prefill_step_size=32), (job, 0))[job.rid] for job in jobs}
    if sampling is GREEDY:
        assert greedy(model, list(ALIKE[0].prompt), 20, fresh_cache=True) != plain["e"] == greedy(
            model, list(ALIKE[0].prompt), 20)
    engine = RowwiseEngine(model, set(), Stages(model), prefixes=PrefixStore(model, prefill_step_size=32),
                           prefill_step_size=32, log=lambda m: m)
    together = []  # each prefill forward's rows
    prefill = engine._prefill
    engine._prefill = lambda rows, n: together.append("".join(r.rid for r in rows)) or prefill(rows, n)
    assert decoded(engine, *((job, 0) for job in jobs)) == plain
    assert together.count("efh") >= 2 and "g" in together, together  # 70 tokens in pieces of 32; g's 45 apart
    assert len(together) < sum(-(-(len(job.prompt) - 1) // 32) for job in jobs)
    turn = replace(jobs[1], rid="f2", prompt=jobs[1].prompt + tuple(plain["f"]) + (7, 8, 9))
    hits, alone = engine.stats()["tape_hit_tokens"], undrafted(model, set(), prefill_step_size=32)
    decoded(alone, (jobs[1], 0))  # the plain decoder's next turn is from its own tape too: V4's caches of a
    # decoded answer are not those of the same tokens prefilled
    assert decoded(engine, (turn, 0)) == decoded(alone, (turn, 0))
    # from the tape: f's prompt and answer, but for the answer's last token where a drafted row never fed it
    assert engine.stats()["tape_hit_tokens"] - hits >= len(jobs[1].prompt) + len(plain["f"]) - 1


def test_a_row_whose_window_is_masked_as_mlx_lm_masks_it_answers_otherwise(model, monkeypatch):
    """The model answers from what each row's caches hold: d (7 prompt tokens) joins rows whose windows have
    rotated, with left padding; masked from where a rotated window writes next (mlx-lm's mask for a forward of
    more than one place, unless the window is put in order first), its seeded answer is not plain decoding's."""
    monkeypatch.setattr(rowwise, "in_order", lambda caches: None)
    jobs = [replace(job, sampling=SEEDED) for job in ROWS]
    plain = decoded(undrafted(model, set(), prefill_step_size=32), (jobs[3], 0))["d"]
    rows = RowwiseEngine(model, set(), Stages(model), prefixes=PrefixStore(model, prefill_step_size=32), prefill_step_size=32)
    assert decoded(rows, *zip(jobs, COMING))["d"] != plain


TOGETHER = [{"messages": [{"role": "user", "content": f"Say more about the {what}."}], "max_tokens": n,
             "temperature": t, "seed": seed}
            for what, n, t, seed in (("pooled keys", 24, 0, 1), ("window", 48, 0.9, 2), ("indexer", 32, 0, 3),
                                     ("stages", 40, 0.9, 4))]


def test_requests_sent_during_a_drafted_answer_or_together_start_at_once_every_row_drafted_every_answer_plain(
        checkpoint, model, tmp_path):
    bias = endless(checkpoint)
    long, short = {**LONG, **bias}, {**SHORT, **bias}
    together = [{**body, **bias} for body in TOGETHER]
    template = load_tokenizer(checkpoint).apply_chat_template
    with start_mesh(checkpoint, 2, tmp_path, *OVERLAY, env=pinned_env()) as mesh:
        mesh.wait_ready(300)
        drafted, second, went = [], [], threading.Event()
        first = threading.Thread(target=stream_ids, args=(mesh.url, long, drafted, went))
        first.start()
        assert went.wait(300), mesh.log(0)[-3000:]
        stream_ids(mesh.url, short, second)
        said_by_then = len(drafted)  # the short answer's whole: the long one still going
        first.join(300)
        batched_before = mesh.status(0)["draft_batched_steps"]
        answers, clients = [[] for _ in together], []
        for body, ids in zip(together, answers):  # each sent once the one before it has SENT_AT tokens
            going = threading.Event()
            clients.append(threading.Thread(target=stream_ids, args=(mesh.url, body, ids, going)))
            clients[-1].start()
            assert going.wait(300), mesh.log(0)[-3000:]
        for client in clients:
            client.join(300)

        def settled():
            statuses = [mesh.status(rank) for rank in range(2)]
            return statuses if all(s and s["state"] == "ready" for s in statuses) else None

        statuses = wait_for(settled, 60, "both ranks' status after the last answer")
        # the short question again alone, asking for no drafts and for the mesh's: the same answer, its usage
        # saying what each drafted
        usages = {}
        for name, extra in (("none", {"draft_tokens": 0}), ("default", {})):
            r = requests.post(f"{mesh.url}/v1/chat/completions", timeout=600, json={**short, **extra})
            assert r.status_code == 200, r.text
            usages[name] = (r.json()["choices"][0]["message"]["content"], r.json()["usage"])
    (none, unasked), (default, asked) = usages["none"], usages["default"]
    assert none == default and unasked["completion_tokens"] == asked["completion_tokens"] == SHORT["max_tokens"]
    assert unasked["draft_tokens"] == {"proposed": 0, "accepted": 0}
    counts = asked["draft_tokens"]
    assert 0 < counts["proposed"] and counts["accepted"] <= counts["proposed"]
    assert len(drafted) == LONG["max_tokens"]
    assert all(s["draft_accepted"] > 0 and s["draft_fallbacks"] == 0 for s in statuses), statuses
    # the short question, sent once the long answer had SENT_AT tokens, was answered whole while the long one went on
    assert SENT_AT <= said_by_then < LONG["max_tokens"] - SHORT["max_tokens"], said_by_then
    # the four that came together were drafted row by row in one batch, the same steps on both ranks
    assert statuses[0]["draft_batched_steps"] == statuses[1]["draft_batched_steps"] > batched_before, statuses
    for body, said in ((long, drafted), (short, second), *zip(together, answers)):
        assert said == plain(model, template(body["messages"], add_generation_prompt=True), body, bias["logit_bias"])
