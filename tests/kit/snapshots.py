"""A mesh whose ranks its agents start, with prefix snapshots: a generation at a time, asked as the proxy
asks (token ids per chunk, resumed answers), and what its disk and /metrics say."""

from __future__ import annotations

import json
import os
import signal
import time

import mlx.core as mx
import requests
from prometheus_client.parser import text_string_to_metric_families

from kit.agents import pid_of, start_generation, stop_generation, wait_mesh_ready
from kit.waiting import wait_for
from runtime.prefix.snapshot import read_header, segment_files

EVERY = 16  # tokens between the snapshots of an answer in flight


class Gen:
    """One generation of the 2-rank mesh, each rank started by its node's agent (its snapshots in the agent's
    state_dir/snapshots/)."""

    def __init__(self, agents, model, generation, ready_within: float = 120, **args):
        self.agents, self.generation = agents, generation
        self.port = start_generation(agents, generation, model,
                                     args={"snapshot_every": EVERY, "heartbeat_interval": 0.05, **args})
        self.url = f"http://127.0.0.1:{self.port}"
        wait_mesh_ready(self.port, ready_within, agents, generation)

    def status(self, rank):
        (rec,) = [r for r in self.agents[rank].ranks() if r["generation"] == self.generation]
        return rec["status"]

    def settled(self, rank):
        """Rank `rank`'s status as a write after this call left it: what the rank counted until now is in it."""
        asked = time.time()
        return wait_for(lambda: (s := self.status(rank))["updated_at"] > asked and s, 10,
                        f"rank {rank}'s next status write")

    def restored(self, rank):
        """Rank `rank`'s status once it restored what it could from the last generation's snapshots (it
        serves while it restores)."""
        asked = time.time()
        return wait_for(lambda: (s := self.status(rank))["updated_at"] > asked and
                        not s["snapshot_restores_pending"] and s, 60, f"rank {rank}'s restores")

    def chat(self, messages, **kw):
        r = requests.post(f"{self.url}/v1/chat/completions", timeout=120,
                          json={"messages": messages, "max_tokens": 24, "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        body = r.json()
        return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    def stream(self, body, resume=None, stop_after=None):
        """What the proxy does (meshd/dataplane/exchange.py): ask for each chunk's token ids, resume from
        those delivered. Returns (meshd's header, ids, chars, cached tokens, the response); `times` holds
        when the request went and when each chunk of tokens came (perf_counter seconds), `counts` how many
        tokens each chunk brought."""
        meshd = {"ids": True, **({"resume": resume} if resume else {})}
        self.times, self.counts = [time.perf_counter()], [0]
        r = requests.post(f"{self.url}/v1/chat/completions", stream=True, timeout=120,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}, "meshd": meshd})
        assert r.status_code == 200, r.text
        head, ids, chars, cached, confirmed = None, list(resume["ids"]) if resume else [], 0, None, None
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith(": meshd "):
                head = json.loads(line[len(": meshd "):])
            elif line.startswith(": ids "):
                c, _, given = line[len(": ids "):].partition(" ")
                confirmed = (int(c), [int(t) for t in given.split(",") if t])
            elif line.startswith("data: {"):
                usage = json.loads(line[len("data: "):]).get("usage")
                if usage:
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                if confirmed:
                    self.times.append(time.perf_counter())
                    chars, got = confirmed
                    self.counts.append(len(got))
                    ids += got
                    confirmed = None
                if stop_after and len(ids) >= stop_after:
                    return head, ids, chars, cached, r
        return head, ids, chars, cached, r

    def sigkill(self, rank):
        os.kill(pid_of(self.agents[rank], self.generation), signal.SIGKILL)

    def stop(self):
        stop_generation(self.agents, self.generation)  # as the controller ends a generation


def metric(agent, name: str, **labels) -> float:
    for family in text_string_to_metric_families(agent.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def answer_in_flight(folder, prompt: list[int], least: int = EVERY, most: int = 4 * EVERY) -> bool:
    """A snapshot of the answer to `prompt` on disk, past its prefill: a tape that holds the prompt but its
    last token and `least` to `most` tokens more, read down its chain (plain KV caches) or whole."""
    headers = {p.name.split(".")[0]: (read_header(p), p) for p in segment_files(folder)}
    for sid, (header, _) in headers.items():
        if not len(prompt) - 1 + least <= int(header["end"]) <= len(prompt) + most:
            continue
        tokens = []
        while sid in headers:
            segment, path = headers[sid]
            tokens = mx.load(str(path))["tokens"].tolist() + tokens
            sid = segment["parent"] if int(segment["start"]) else ""
        if len(tokens) == int(header["end"]) and tokens[:len(prompt)] == prompt:
            return True
    return False
