"""Invisible recovery on a real 2-rank mesh: a stream cut by a rank's death
resumes on the next generation under the same id, and the client's text is
what an uncut run of the same request gives (greedy, and seeded sampling);
rank 0's own error before the first byte is retried, not passed on; a client
that leaves while its stream waits for the next generation is not resumed.
And what a client waits for is not a silence: a long prefill's progress comes
through the proxy in its stream, and `meshctl status` shows it."""

import json
import os
import re
import signal

import pytest
import requests
from openai import OpenAI

from agents.signatures import classify
from common.states import Role
from kit.demo_answers import endless
from kit.meshctl import mesh_up, meshctl
from kit.openai import sse_events, validate
from kit.waiting import wait_for


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, demo_model):
    with mesh_up(tmp_path_factory.mktemp("migration"), demo_model, proxy={"keepalive_interval": 0.5},
                 runtime={"args": {"model_name": "demo", "max_tokens_limit": 4096, "prefill_step_size": 256,
                                   "prefill_report_every": 0}}) as running:
        yield running


def status(config) -> dict:
    return json.loads(meshctl(config, "status", "--json").stdout)


def ready(config, after: int) -> dict:
    return wait_for(lambda: (s := status(config))["phase"] == "ready" and s["generation"] > after and s, 120,
                    f"a generation after {after}")


def stream(config, body, on_chunk=None) -> list:
    """POST a streamed chat request; call on_chunk(n) after each data chunk; return its events."""
    r = requests.post(f"{status(config)['urls']['proxy']}/chat/completions", json={**body, "stream": True},
                      stream=True, timeout=300)
    events, n = [], 0
    for line in r.iter_lines(decode_unicode=True):
        events += sse_events([line])
        if line.startswith("data: ") and on_chunk:
            n += 1
            on_chunk(n)
    return events


def text_of(events) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


def kill_at(agent, chunk: int):
    """on_chunk callback: SIGKILL `agent`'s rank when the stream reaches `chunk` chunks."""
    def on_chunk(n):
        if n == chunk:
            os.kill(agent.ranks()[-1]["pid"], signal.SIGKILL)
    return on_chunk


def assert_one_clean_stream(events):
    assert events[-1] == "[DONE]" and not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]
    chunks = [e for e in events if isinstance(e, dict)]
    assert len({e["id"] for e in chunks}) == 1 and len({e["created"] for e in chunks}) == 1
    assert sum(1 for e in chunks if e["choices"] and "role" in e["choices"][0]["delta"]) == 1
    for e in chunks:
        validate(e, "CreateChatCompletionStreamResponse")


PREFILL = re.compile(r"^: prefill (\d+)/(\d+) tokens")
SHOWN = re.compile(r"^prefill (cmpl-\S+) on node0 rank 0: (\d+)/(\d+) tokens", re.M)


def test_a_long_prefill_is_said_in_its_stream_and_in_meshctl_status_as_it_goes_in(mesh, demo_model):
    """A 4k-token prompt in chunks of 256, each chunk said (prefill_report_every = 0): its `: prefill` comments
    come through the proxy before its first token, further in each time, the last one chunk short of the whole;
    while rank 1 is stopped in the middle, `meshctl status` shows where it is. An OpenAI client reads such a
    stream as any other."""
    config, agents = mesh
    ready(config, 0)
    proxy = status(config)["urls"]["proxy"]
    long = "The ranks step in lockstep. " * 556  # 7 tokens each: 3892, with the demo model's 4096 of context
    r = requests.post(f"{proxy}/completions", stream=True, timeout=300,
                      json={"model": "demo", "prompt": long, "max_tokens": 4, "stream": True,
                            "stream_options": {"include_usage": True}})
    lines, stopped = [], None
    try:
        for line in r.iter_lines(decode_unicode=True):
            lines.append(line)
            if stopped is None and PREFILL.match(line):
                stopped = agents[1].ranks()[-1]["pid"]
                os.kill(stopped, signal.SIGSTOP)  # rank 0 cannot take the next chunk without it
                shown = wait_for(lambda: SHOWN.search(meshctl(config, "status").stdout), 60,
                                 "meshctl status to show the prefill")
                os.kill(stopped, signal.SIGCONT)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
    first = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    said = [(int(m[1]), int(m[2])) for m in map(PREFILL.match, lines[:first]) if m]
    (usage,) = [e["usage"] for e in sse_events(lines) if isinstance(e, dict) and e.get("usage")]
    total = usage["prompt_tokens"]
    assert total > 3800 and {t for _, t in said} == {total}
    done = [d for d, _ in said]
    assert len(done) >= 8 and done == sorted(set(done)) and total - done[-1] <= 256, done
    assert not any(PREFILL.match(line) for line in lines[first:])
    assert int(shown[2]) < total and int(shown[3]) == total and int(shown[2]) in done, shown[0]

    client = OpenAI(base_url=proxy, api_key="unused", max_retries=0)
    other = "Each answer streams through the proxy. " * 96  # 2208 tokens of its own: no tape holds them
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="demo", prompt=other, max_tokens=8,
                                                                             stream=True) if c.choices)
    whole = client.completions.create(model="demo", prompt=other, max_tokens=8)
    assert streamed == whole.choices[0].text and whole.usage.prompt_tokens >= 2048


@pytest.mark.parametrize("victim,body", [
    # 300 tokens: long enough that the kill lands mid-answer even when the client reads chunk 6 late
    (0, {"messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 300}),
    (1, {"messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 300, "temperature": 1.0,
         "seed": 23, "stream_options": {"include_usage": True}}),
], ids=["greedy, rank 0 killed", "seeded sampling, rank 1 killed"])
def test_a_stream_cut_by_a_death_resumes_and_reads_as_one_uncut_answer(mesh, demo_model, victim, body):
    config, agents = mesh
    body = {**body, **endless(demo_model)}
    g = ready(config, 0)["generation"]
    uncut = stream(config, body)
    cut = stream(config, body, kill_at(agents[victim], 6))
    assert ready(config, g)["generation"] == g + 1
    assert_one_clean_stream(cut)
    assert text_of(cut) == text_of(uncut) and text_of(cut)
    if body.get("stream_options"):  # the whole answer counted once
        (usage,) = [e["usage"] for e in cut if isinstance(e, dict) and e.get("usage")]
        (whole,) = [e["usage"] for e in uncut if isinstance(e, dict) and e.get("usage")]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (whole["prompt_tokens"], body["max_tokens"])
    incident = json.loads(meshctl(config, "events", "--json").stdout)["incidents"][0]
    assert (incident["generation"], incident["node"], incident["migrated"]) == (g, f"node{victim}", 1), incident
    metrics = requests.get(status(config)["urls"]["proxy_metrics"], timeout=5).text
    assert float(re.search(r"^meshd_proxy_migrations_total (\S+)", metrics, re.M).group(1)) >= 1


def test_rank_0s_error_before_the_first_byte_is_retried_not_passed_on(mesh):
    config, agents = mesh
    g = ready(config, 0)["generation"]
    victim = agents[1].ranks()[-1]["pid"]
    os.kill(victim, signal.SIGSTOP)  # rank 0 takes the request, but no step runs without rank 1
    proxy = status(config)["urls"]["proxy"]
    r = requests.post(f"{proxy}/chat/completions", stream=True, timeout=120,
                      json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True})
    lines = r.iter_lines(decode_unicode=True)
    # A keep-alive means the proxy reads rank 0's answer: rank 0 holds the request.
    assert next(lines).startswith(": keep-alive")
    os.kill(victim, signal.SIGKILL)  # rank 0's collective fails: it answers with an error event, before any data
    events = sse_events(lines)
    assert ready(config, g)["generation"] > g
    assert_one_clean_stream(events)
    assert text_of(events)
    # rank 0 lost its peer, in whichever of the ring's words (a lost connection, a socket closed, a failed recv)
    rank0_log = agents[0].get(f"/v1/ranks/{g}/0/log?lines=200").json()["lines"]
    lost = {s.name for line in rank0_log if (s := classify(line)) and s.role is Role.CONSEQUENCE}
    assert lost & {"ring_peer_lost", "ring_peer_closed", "ring_send_failed"}, rank0_log


def test_a_client_gone_while_its_stream_waits_is_not_resumed(mesh, demo_model):
    config, agents = mesh
    g = ready(config, 0)["generation"]
    proxy = status(config)["urls"]["proxy"]
    r = requests.post(f"{proxy}/chat/completions", stream=True, timeout=60,
                      json={"messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 2000,
                            "temperature": 1.0, "seed": 23, "stream": True, **endless(demo_model)})
    lines = r.iter_lines(decode_unicode=True)
    next(line for line in lines if line.startswith("data: "))
    os.kill(agents[1].ranks()[-1]["pid"], signal.SIGKILL)
    next(line for line in lines if line.startswith(": keep-alive"))  # the proxy holds the stream open
    r.close()

    def in_flight() -> float:
        metrics = requests.get(status(config)["urls"]["proxy_metrics"], timeout=5).text
        return float(next(line.split()[-1] for line in metrics.splitlines()
                          if line.startswith("meshd_proxy_requests_in_flight ")))

    wait_for(lambda: in_flight() == 0, 30, "the proxy to free the request's place")
    after = ready(config, g)
    assert all((a.ranks()[-1]["status"] or {}).get("tokens", 0) == 0 for a in agents), "nothing was resumed"
    assert after["phase"] == "ready"
