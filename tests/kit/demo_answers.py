"""Requests that shape the demo model's answers (its weights are random)."""

from __future__ import annotations

import json
from pathlib import Path


def endless(model) -> dict:
    """Request fields that keep a model from ending its answer before max_tokens: its end-of-turn token
    biased away (the demo model's random weights would end a sampled answer at any length)."""
    eos = json.loads((Path(model) / "config.json").read_text())["eos_token_id"]
    return {"logit_bias": {str(t): -100 for t in (eos if isinstance(eos, list) else [eos])}}
