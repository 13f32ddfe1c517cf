"""The lockstep loop's side of rank 0's frontend (runtime/server.py), without a model: it takes what the
frontend hands the ranks and answers each job with the next scripted answer, as the real tokenizer's tokens one
emission at a time. The jobs of one exchange (a request's `n` rows) are answered a token of each in turn, as a
batch answers them."""

from __future__ import annotations

import queue
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import requests

from kit.waiting import wait_for
from meshd.meshctl.ports import free_ports
from runtime.engine.jobs import Emission, Job
from runtime.lockstep import Insert
from runtime.rank import warmup_prompt
from runtime.server import WARMUP, Frontend


@dataclass(frozen=True)
class Script:
    """One job's answer: its text, how it ends ("stop": EOS after it; "length": its last token ends it, as
    max_tokens does), how many prompt tokens the ranks took from their cache."""

    text: str
    finish: str = "stop"
    cached: int = 0


class ScriptedRanks:
    def __init__(self, fe: Frontend, tokenizer):
        self.fe, self.tok = fe, tokenizer
        self.answers: queue.Queue[Script | str] = queue.Queue()
        self.jobs: list[Job] = []  # as the frontend handed them to the ranks
        self.eos = sorted(tokenizer.eos_token_ids)[0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def prompts(self) -> list[list[int]]:
        return [list(job.prompt) for job in self.jobs]

    def _run(self) -> None:
        while not self._stop.is_set():
            jobs = [m.job for m in self.fe.collect(block=True, timeout=0.05) if isinstance(m, Insert)]
            answers = []
            for job in jobs:
                if job.rid == WARMUP:
                    self.fe.started(job.rid, 0)
                    self.fe.emit([Emission(job.rid, self.eos, "length")])
                    continue
                self.jobs.append(job)
                script = self.answers.get_nowait()
                script = Script(script) if isinstance(script, str) else script
                self.fe.started(job.rid, script.cached)
                tokens = self.tok.encode(script.text, add_special_tokens=False)
                ends = [None] * (len(tokens) - 1) + ["length"] if script.finish == "length" else \
                    [None] * len(tokens) + ["stop"]
                answers.append([Emission(job.rid, t, why) for t, why in
                                zip(tokens + ([] if script.finish == "length" else [self.eos]), ends)])
            while any(answers):  # a token of each row in turn
                self.fe.emit([a.pop(0) for a in answers if a])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@contextmanager
def scripted_rank0(tokenizer, limits):
    """Rank 0's real frontend on a real port over `tokenizer`, its doors opened by the warm-up through scripted
    ranks: its base URL (`.../v1`) and the ranks."""
    port, = free_ports(1)
    fe = Frontend(tokenizer, limits, generation=1, context_length=4096, host="127.0.0.1", port=port)
    fe.start()
    ranks = ScriptedRanks(fe, tokenizer)
    fe.warm_up(warmup_prompt(tokenizer))
    wait_for(lambda: requests.get(f"http://127.0.0.1:{port}/internal/ready", timeout=2).status_code == 200, 10,
             "rank 0's doors to open")
    try:
        yield f"http://127.0.0.1:{port}/v1", ranks
    finally:
        ranks.stop()
        fe.stop()
