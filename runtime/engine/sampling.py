"""How a job's tokens are drawn: greedy, or seeded per token so that any rank,
any batch and any resumed answer draws the same; and the job's logits processors (its grammar's mask last,
so no bias or penalty brings back a token the grammar refuses)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from runtime.engine import grammar
from runtime.engine.jobs import Job
from runtime.prefix.tape import common_prefix


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


MASK64 = (1 << 64) - 1


def token_key(seed: int, i: int) -> mx.array:
    """The random key of an answer's token i: a function of the seed and i alone (splitmix64 of
    both), so an answer resumed at token i on another generation draws what it would have."""
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return mx.random.key((z ^ (z >> 31)) & ((1 << 63) - 1))


def seeded(seed: int, sampling: dict, i: int, logprobs: mx.array) -> mx.array:
    """Token i of an answer drawn at its temperature after top-k, min-p and top-p, with `token_key(seed, i)`: the
    same seed replays the same tokens, on every rank, whatever else shares the batch, and from any token on."""
    top_k, min_p, top_p = sampling["top_k"], sampling["min_p"], sampling["top_p"]
    if 0 < top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, top_k)
    if min_p > 0.0:
        logprobs = apply_min_p(logprobs, min_p)
    if 0.0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    return mx.random.categorical(logprobs * (1.0 / sampling["temperature"]), key=token_key(seed, i))


def sample_at(job: Job, i: int, logprobs: mx.array) -> mx.array:
    """The job's token i from `logprobs` (one row, [1, vocab], as plain decoding holds it), drawn as plain
    decoding draws it: greedy, or with token_key(seed, i)."""
    return greedy(logprobs) if job.sampling["temperature"] == 0.0 else \
        seeded(job.seed, job.sampling, job.offset + i, logprobs)


REREAD = 64  # the answer's last tokens a mask reads again: only a verify's drafts, fewer, change under it


class GrammarMask:
    """mlx-lm's logits processor for one answer held to a grammar: logits of tokens the grammar does not
    allow next become -inf. `answer_start`: where the answer begins in the tokens it is shown (the prompt's
    length, less the tokens of a resumed answer that the prompt carries). A prompt that leaves a think block
    open lets the answer reason first: the grammar holds what follows the block's close, and the reasoning
    may say anything but the end.

    Per token it reads from the device only the answer's new tokens (and the last REREAD) and sends the mask
    as bools, or to a GPU as bits (`grammar.unpack_on_host`). The read is queued first and the step's forward
    after it, so the host waits for the tokens alone and builds the mask while the forward runs: queued the
    other way round, the read waited for the forward and a held token cost 1.54x an unheld one's on an H100,
    not queued at all 1.19x (bench/grammar.py, docs/BENCHMARKS.md)."""

    def __init__(self, text: str, prompt, answer_start: int):
        self._text = text
        self._matcher = grammar.compiled(text)
        self._start = answer_start
        self._reasoning_first = grammar.think_open(prompt[:answer_start])
        self._eos = tuple(grammar.eos_tokens())
        self._on_host = grammar.unpack_on_host(mx.default_device())
        self._answer: list[int] = []  # the answer as the last call read it
        self._said: list[int] = []  # the held tokens the matcher consumed

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        held = grammar.held(self._read(tokens, logits), self._reasoning_first)
        if held is None:
            allowed = grammar.reasoning_tokens(logits.shape[-1], self._eos)
        elif self._follow(held) or self._matcher.is_error():  # an errored matcher allows nothing: the end
            allowed = grammar.allowed_tokens(self._matcher.compute_bitmask(), logits.shape[-1], self._eos,
                                             self._on_host)
        else:
            return logits  # past a draft the grammar refuses: the verify keeps nothing from this place
        return mx.where(allowed, logits, grammar.refused(logits.dtype))

    def _read(self, tokens: mx.array, logits: mx.array) -> list[int]:
        """The answer in `tokens`: the last call's, but for its last REREAD tokens, and what follows them; the
        `logits`' forward started behind that read."""
        keep = max(0, min(len(self._answer) - REREAD, tokens.shape[0] - self._start))
        new = tokens[self._start + keep:]
        mx.async_eval(new)
        mx.async_eval(logits)
        self._answer[keep:] = new.tolist()
        return self._answer

    def _follow(self, answer: list[int]) -> bool:
        """Bring the matcher to `answer`; False when a token of it is one the grammar does not allow."""
        n = common_prefix(self._said, answer)
        if n < len(self._said) or self._matcher.is_error():
            if self._matcher.is_error():  # which rolls back no more: a fresh one from the answer's start
                self._matcher, n = grammar.compiled(self._text), 0
            else:
                self._matcher.rollback(len(self._said) - n)
            del self._said[n:]
        rest = answer[n:]
        k = self._matcher.try_consume_tokens(rest) if rest else 0
        self._said += rest[:k]
        return k == len(rest)


def processors_for(job: Job) -> list:
    """mlx-lm's logits processors for the job's logit_bias, penalties and grammar (none when all are off)."""
    s = job.sampling
    mask = [GrammarMask(s["grammar"], job.prompt, len(job.prompt) - job.offset)] if s.get("grammar") else []
    return make_logits_processors(logit_bias={int(t): b for t, b in s["logit_bias"]} or None,
                                  repetition_penalty=s["repetition_penalty"] if s["repetition_penalty"] != 1.0 else None,
                                  presence_penalty=s["presence_penalty"] or None,
                                  frequency_penalty=s["frequency_penalty"] or None) + mask
