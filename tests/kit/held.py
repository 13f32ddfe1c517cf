"""Answers held to a grammar, from one process's engine: what a mesh's held answers are compared with."""

from __future__ import annotations

from common import openai_api as oa
from runtime.engine import grammar
from runtime.engine.jobs import Job


def held_tokens(engine, tokenizer, body: dict, context: int = 8192) -> list[int]:
    """The answer's tokens (its end left out) from `engine` (world 1), the chat body parsed and rendered as
    rank 0 does (its grammar against the tokenizer runtime/engine/grammar.py serves)."""
    req = oa.parse_request("chat", body, oa.Limits("m", 0, context), internal=True, grammars=grammar.builder())
    prompt = tokenizer.apply_chat_template(list(req.messages), add_generation_prompt=True,
                                           tools=list(req.tools) or None, **req.template_kwargs)
    engine.insert(Job("r", tuple(prompt), req.params.max_tokens, req.params.seed or 0, req.params.sampling()))
    tokens = []
    while engine.busy:
        tokens += [e.token for e in engine.step() if e.token not in tokenizer.eos_token_ids]
    return tokens
