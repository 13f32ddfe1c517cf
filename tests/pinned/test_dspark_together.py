"""No request waits behind a drafted answer, on omlx's REAL DeepSeek-V4 at TP2 on the ring (real meshd-rank
processes over loopback, the tiny checkpoint of pinned.dsv4, its compressed layers' pooled caches): a request
sent while a lone request's answer is being drafted starts at the next step, the drafted answer handed over to
the batch keeping its place exactly, on both ranks; each answer is plain decoding's, token for token; the next
request alone is drafted again.

Run: .venv-omlx/bin/python -m pytest tests/pinned/test_dspark_together.py"""

import re
import threading

import pytest
import requests
from mlx_lm.utils import load_tokenizer

from kit.demo_answers import endless
from kit.ranks import start_mesh
from kit.waiting import wait_for
from pinned.dsv4 import OVERLAY, PROMPT, pinned_env
from runtime.drafting import DraftWhenAlone, DSparkEngine
from runtime.engine import BatchEngine
from runtime.jobs import Job
from runtime.openai_api import SamplingParams

LONG = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 96, "temperature": 0}
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
    engine = BatchEngine(model, set(), prefill_step_size=128)
    engine.insert(Job("p", tuple(prompt), body["max_tokens"], body.get("seed", 0), sampling))
    tokens = []
    while engine.busy:
        tokens += [e.token for e in engine.step() if e.token is not None]
    return tokens


GREEDY = SamplingParams(max_tokens=1).sampling()
SEEDED = SamplingParams(max_tokens=1, temperature=0.9, seed=7).sampling()
A = tuple(range(60, 150))  # past the ratio-4 layers' index_topk * 4: their sparse path
B = tuple(range(300, 320))


def decoded(engine, *jobs: tuple[Job, int]) -> dict[str, list[int]]:
    """Each job's tokens, each inserted after its given count of the engine's steps."""
    said, steps = {job.rid: [] for job, _ in jobs}, 0
    while steps <= max(at for _, at in jobs) or engine.busy:
        for job, at in jobs:
            if at == steps:
                engine.insert(job)
        for e in engine.step():
            said[e.rid] += [e.token] if e.token is not None else []
        steps += 1
    return said


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_drafted_answer_handed_over_in_its_prompt_at_its_first_token_or_mid_way_goes_on_as_plain_decoding(
        model, sampling):
    a, b = Job("a", A, 40, 3, sampling), Job("b", B, 12, 4, sampling)
    plain = {job.rid: decoded(BatchEngine(model, set(), prefill_step_size=32), (job, 0))[job.rid] for job in (a, b)}
    batch = BatchEngine(model, set(), prefill_step_size=32)
    engine = DraftWhenAlone(DSparkEngine(model, set(), prefill_step_size=32, prefixes=batch), batch, log=lambda m: m)
    for at in (1, 3, 9):  # the drafter in a's prompt (90 tokens, 32 a step), at a's first verify, mid-way
        assert decoded(engine, (a, 0), (b, at)) == plain
    assert engine.handovers == 3 and engine.stats()["draft_proposed"] > 0


def test_a_request_sent_during_a_drafted_answer_starts_at_the_next_step_and_both_answer_plainly(
        checkpoint, model, tmp_path):
    bias = endless(checkpoint)
    long, short = {**LONG, **bias}, {**SHORT, **bias}
    template = load_tokenizer(checkpoint).apply_chat_template
    with start_mesh(checkpoint, 2, tmp_path, *OVERLAY, env=pinned_env()) as mesh:
        mesh.wait_ready(300)
        drafted, second, went = [], [], threading.Event()
        first = threading.Thread(target=stream_ids, args=(mesh.url, long, drafted, went))
        first.start()
        assert went.wait(300), mesh.log(0)[-3000:]
        stream_ids(mesh.url, short, second)
        first.join(300)
        alone_before = mesh.status(0)["draft_proposed"]
        again = []
        stream_ids(mesh.url, {**short, "max_tokens": 24}, again)

        def settled():
            statuses = [mesh.status(rank) for rank in range(2)]
            return statuses if all(s and s["draft_proposed"] > alone_before and s["state"] == "ready"
                                   for s in statuses) else None

        statuses = wait_for(settled, 60, "both ranks' status after the last answer")
        logs = [mesh.log(rank) for rank in range(2)]
    assert len(drafted) == LONG["max_tokens"]
    assert all(s["draft_accepted"] > 0 and s["draft_fallbacks"] == 0 for s in statuses), statuses
    # every rank handed the drafted answer over once, mid-way, at the same token; the second request's first
    # token came at the third step after it arrived: the handover's step starts its prompt, and mlx-lm's batch
    # samples a new row's first token two steps after it takes the prompt in (as when nothing was drafted)
    handovers = [re.findall(r"came while \S+ was drafted \((\d+) tokens said\): .* first token (\d+) steps", log)
                 for log in logs]
    assert handovers[0] == handovers[1] and len(handovers[0]) == 1, logs[0][-3000:]
    [(said, steps)] = handovers[0]
    assert SENT_AT <= int(said) < LONG["max_tokens"] and int(steps) <= 3, handovers
    for body, said in ((long, drafted), (short, second), ({**short, "max_tokens": 24}, again)):
        assert said == plain(model, template(body["messages"], add_generation_prompt=True), body, bias["logit_bias"])
