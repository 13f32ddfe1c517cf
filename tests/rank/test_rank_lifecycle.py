"""Rank lifecycle on real 2-rank meshes: drain (finish, cancel, SIGTERM), load
and prefill progress in the status file, speculative decoding."""

import re
import signal
import threading
import time

import requests

from agents.signatures import classify
from common.fingerprint import weights_digest
from kit.agents import make_agents, start_generation, stop_generation, wait_mesh_ready
from kit.demo_answers import endless
from kit.openai import sse_events, validate
from kit.ranks import StatusTrace, start_mesh
from kit.waiting import wait_for


def stream_in_background(mesh, body):
    """POST a streamed chat request on a thread; returns (thread, result dict)."""
    result = {}

    def run():
        r = requests.post(f"{mesh.url}/v1/chat/completions", json={**body, "stream": True}, stream=True,
                          timeout=120)
        result["events"] = sse_events(r.iter_lines(decode_unicode=True))

    t = threading.Thread(target=run)
    t.start()
    return t, result


def busy_everywhere(mesh):
    return all((mesh.status(r) or {}).get("requests_in_flight") == 1 for r in range(len(mesh.procs)))


def test_drain_finish_completes_in_flight_work_and_every_rank_exits_0(demo_model, tmp_path):
    with start_mesh(demo_model, 2, tmp_path, "--heartbeat-interval", "0.05") as mesh:
        mesh.wait_ready()
        t, result = stream_in_background(mesh, {"messages": [{"role": "user", "content": "long"}],
                                                "max_tokens": 400, "temperature": 0.9, "seed": 3,
                                                **endless(demo_model)})
        wait_for(lambda: busy_everywhere(mesh), 30, "the request to be in flight on every rank")
        r = requests.post(f"{mesh.url}/internal/drain", json={"mode": "finish"}, timeout=10)
        assert r.status_code == 202
        late = requests.post(f"{mesh.url}/v1/chat/completions", timeout=10,
                             json={"messages": [{"role": "user", "content": "late"}]})
        assert late.status_code == 503 and late.headers["Retry-After"]
        validate(late.json(), "ErrorResponse")
        t.join(120)
        events = result["events"]
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert mesh.wait_exit() == [0, 0]
        assert all(mesh.status(r)["state"] == "exited" for r in range(2))
        assert all(mesh.status(r)["tokens"] == 400 for r in range(2))


def test_drain_cancel_cuts_in_flight_work_cleanly(demo_model, tmp_path):
    with start_mesh(demo_model, 2, tmp_path) as mesh:
        mesh.wait_ready()
        t, result = stream_in_background(mesh, {"messages": [{"role": "user", "content": "long"}],
                                                "max_tokens": 4000, "temperature": 0.9, "seed": 3,
                                                **endless(demo_model)})
        wait_for(lambda: busy_everywhere(mesh), 30, "the request to be in flight on every rank")
        assert requests.post(f"{mesh.url}/internal/drain", json={"mode": "cancel"}, timeout=10).status_code == 202
        t.join(120)
        events = result["events"]
        assert events[-1] == "[DONE]"
        assert "error" in events[-2]
        validate(events[-2], "ErrorResponse")
        assert mesh.wait_exit() == [0, 0]
        tokens = [mesh.status(r)["tokens"] for r in range(2)]
        assert tokens[0] == tokens[1] < 4000


def test_sigterm_on_rank0_drains_every_rank(demo_model, tmp_path):
    with start_mesh(demo_model, 2, tmp_path) as mesh:
        mesh.wait_ready()
        mesh.procs[0].send_signal(signal.SIGTERM)
        assert mesh.wait_exit() == [0, 0]


def test_a_storm_of_sigterms_mid_stream_is_still_one_finishing_drain(demo_model, tmp_path):
    """The handler only records: a SIGTERM that lands while the main thread holds the frontend's lock
    (it takes it for every token) must not deadlock the rank into a SIGKILL."""
    with start_mesh(demo_model, 2, tmp_path) as mesh:
        mesh.wait_ready()
        t, result = stream_in_background(mesh, {"messages": [{"role": "user", "content": "long"}],
                                                "max_tokens": 300, "temperature": 0.9, "seed": 5,
                                                **endless(demo_model)})
        wait_for(lambda: busy_everywhere(mesh), 30, "the request to be in flight on every rank")
        for _ in range(2000):
            if mesh.procs[0].poll() is not None:
                break
            mesh.procs[0].send_signal(signal.SIGTERM)
            time.sleep(0.0005)
        assert mesh.wait_exit(timeout=90) == [0, 0]
        t.join(30)
        assert result["events"][-1] == "[DONE]"
        assert result["events"][-2]["choices"][0]["finish_reason"] == "length"


def test_sigterm_on_another_rank_waits_for_rank0s_drain(demo_model, tmp_path):
    with start_mesh(demo_model, 2, tmp_path, "--drain-wait", "60") as mesh:
        mesh.wait_ready()
        mesh.procs[1].send_signal(signal.SIGTERM)
        wait_for(lambda: "waiting up to" in mesh.log(1), 10, "rank 1 to acknowledge SIGTERM")
        assert mesh.procs[1].poll() is None
        assert requests.post(f"{mesh.url}/v1/chat/completions", timeout=30,
                             json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}).ok
        requests.post(f"{mesh.url}/internal/drain", json={"mode": "finish"}, timeout=10)
        assert mesh.wait_exit() == [0, 0]


def test_sigterm_on_another_rank_gives_up_after_the_bound(demo_model, tmp_path):
    with start_mesh(demo_model, 2, tmp_path, "--drain-wait", "0.5") as mesh:
        mesh.wait_ready()
        mesh.procs[1].send_signal(signal.SIGTERM)
        assert mesh.procs[1].wait(timeout=30) == 128 + signal.SIGTERM


def test_status_file_shows_load_and_long_prefill_progress(deep_model, tmp_path):
    with start_mesh(deep_model, 2, tmp_path, "--heartbeat-interval", "0.02", "--prefill-step-size", "32") as mesh:
        with StatusTrace(mesh.status_files[1], interval=0.001) as load:
            mesh.wait_ready()
        loading = [s for s in load.snapshots if s["state"] == "loading"]
        # The status keeps its load count once armed: the last step can be read there when the rank arms
        # within the trace's millisecond
        assert loading and max(s["load_done"] for s in load.snapshots) == loading[-1]["load_total"] == 25
        assert len({s["load_done"] for s in loading}) >= 3, "load progress was not reported step by step"
        assert [s["state"] for s in load.snapshots if s["state"] != "loading"][:1] in (["armed"], ["ready"])

        prompt = "The ranks step in lockstep. " * 40  # about 280 tokens: 9 steps of 32
        with StatusTrace(mesh.status_files[1], interval=0.001) as trace:
            r = requests.post(f"{mesh.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                              timeout=600)
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        prefill = [s for s in trace.snapshots if s["state"] == "busy" and s["prompt_tokens_in_flight"] > 0]
        assert len(prefill) >= 2, trace.snapshots
        assert prefill[0]["prompt_tokens_in_flight"] <= prompt_tokens
        assert prefill[-1]["step"] > prefill[0]["step"]
        assert prefill[-1]["prompt_tokens_in_flight"] < prefill[0]["prompt_tokens_in_flight"]
        assert prefill[-1]["progress_at"] > prefill[0]["progress_at"]


def test_speculative_greedy_equals_plain_greedy_on_two_ranks(demo_model, draft_model, reference, tmp_path):
    with start_mesh(demo_model, 2, tmp_path, "--draft-model", str(draft_model), "--num-draft-tokens", "3") as mesh:
        mesh.wait_ready()
        before = mesh.status(0)  # the warm-up's drafts
        usages = []
        for content, asked in [("hello world", {}), ("The quick brown fox", {}), ("hello world", {"draft_tokens": 0})]:
            messages = [{"role": "user", "content": content}]
            r = requests.post(f"{mesh.url}/v1/chat/completions", timeout=60,
                              json={"messages": messages, "max_tokens": 24, **asked})
            assert r.status_code == 200, r.text
            ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            assert r.json()["choices"][0]["message"]["content"] == reference(ids, 24)
            usages.append(r.json()["usage"]["draft_tokens"])
        # each verify proposes 3 drafts while 3 tokens are left; asked for none, the answer is undrafted
        assert all(3 <= d["proposed"] <= 3 * 24 and d["accepted"] <= d["proposed"] for d in usages[:2]), usages
        assert usages[2] == {"proposed": 0, "accepted": 0}
        # the rank's own totals (its status file, the agent's metrics) grew by the answers' drafts
        want = tuple(before[f"draft_{k}"] + sum(d[k] for d in usages) for k in ("proposed", "accepted"))
        said = wait_for(lambda: (s := mesh.status(0)) and (s.get("draft_proposed"), s.get("draft_accepted")) == want
                        and s, 30, f"rank 0's status file to count the answers' drafts {want}")
        assert said["drafter"] == "draft_model"
        r = requests.post(f"{mesh.url}/v1/chat/completions", stream=True, timeout=60,
                          json={"messages": [{"role": "user", "content": "s"}], "max_tokens": 8, "stream": True})
        assert sse_events(r.iter_lines(decode_unicode=True))[-1] == "[DONE]"


def test_a_one_node_ring_mesh_serves_through_its_agent(demo_model, reference, tmp_path):
    """A mesh of one is a mesh: its agent starts the rank from a one-host ring hostfile, the rank serves,
    and the agent's /metrics carries the rank's token tape counts (a follow-up turn is a hit)."""
    (agent,) = make_agents(tmp_path, 1)
    agent.start()
    try:
        port = start_generation([agent], 1, demo_model)
        wait_mesh_ready(port)
        assert requests.get(f"http://127.0.0.1:{port}/internal/ready", timeout=5).json() == \
            {"ready": True, "phase": "admitting", "generation": 1, "weights_fingerprint": weights_digest(demo_model)}
        ids = reference.tokenizer.encode("The ranks step")
        turn = {"prompt": "The ranks step", "max_tokens": 8, "draft_tokens": 2}  # an undrafted mesh: no effect
        first = requests.post(f"http://127.0.0.1:{port}/v1/completions", json=turn, timeout=60).json()
        assert first["choices"][0]["text"] == reference(ids, 8) and "draft_tokens" not in first["usage"]
        turn["prompt"] += first["choices"][0]["text"] + " and then"
        follow = requests.post(f"http://127.0.0.1:{port}/v1/completions", json=turn, timeout=60).json()
        assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] > len(ids)
        assert [r["status"]["world"] for r in agent.ranks()] == [1]

        def hits():
            found = re.search(r'^meshd_agent_rank_tape_lookups_total\{[^}]*outcome="hit"[^}]*\} ([0-9.]+)$',
                              agent.get("/metrics").text, re.M)
            return found and float(found.group(1)) >= 1
        wait_for(hits, 10, "the tape's hit in the agent's /metrics")
    finally:
        stop_generation([agent], 1)
        agent.kill()


def test_ranks_that_sample_different_tokens_end_the_generation_naming_the_step(demo_model, tmp_path):
    """MESHD_FAULT_FLIP_TOKEN makes rank 1's 6th sampled token (the readiness generation's is the 1st)
    count as another one: the digests part at the next exchange and every rank stops there."""
    with start_mesh(demo_model, 2, tmp_path, env={"MESHD_FAULT_FLIP_TOKEN": "1:6"}) as mesh:
        mesh.wait_ready()
        r = requests.post(f"{mesh.url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 30,
                                **endless(demo_model)})
        assert r.status_code == 503 and r.json()["error"]["code"] == "generation_failed"
        assert mesh.wait_exit() == [1, 1]
        for rank in range(2):
            line = next(l for l in mesh.log(rank).splitlines() if "[meshd] divergence" in l)
            assert classify(line).name == "divergence" and " at step " in line
