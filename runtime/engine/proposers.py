"""Who proposes a row's drafts: DeepSeek-V4's DSpark stages, the model's own MTP head, a draft model, or nobody (plain
decoding: `Undrafted`). The row-wise engine (runtime/engine/rowwise.py) is the same for each; a proposer says how the
target is run (`forward`: its logits, and the states its drafts are made from), what a row's drafter holds
(`context`), what it learns of a prompt going in (`prefilled`) and the row's next drafts after a verify (`draft`),
each taken greedily from logits its request's grammar allows. A drafter's mistakes cost only speed: the target keeps
a draft only where it samples that token itself.

Each method gets the row after its caches took the positions the states are of (`row.base` counts them)."""

from __future__ import annotations

import sys
from typing import Protocol

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from runtime.engine.drafting import allowed_by
from runtime.engine.request import Request
from runtime.models import dspark, pools
from runtime.prefix.store import Prefix


class Proposer(Protocol):
    drafter: str  # as the engine's stats name it
    who: str  # as a refusal names it

    def width(self, asked: int) -> int:
        """The most drafts a row takes a step, of `asked` (0: the drafter's own)."""

    def armed(self, width: int) -> str:
        """The drafter as the rank's log says it is armed, drafting `width` a step."""

    def arm(self, flag: bool) -> None:
        """The target's verify of a lone row's drafts armed (omlx's decode-consistent verify) or not."""

    def context(self, prefix: Prefix) -> list:
        """A new row's drafter context, given what the prefix store gave it."""

    def forward(self, inputs: mx.array, cache: list) -> tuple[mx.array, mx.array | None]:
        """The target's logits at `inputs` and the states its drafts are made from."""

    def committed(self, row: Request, states) -> None:
        """The row's caches took these positions, drafted or not: what of their states its tape keeps for a next
        turn's drafts (`row.recent`)."""

    def prefilled(self, row: Request, states, following: mx.array) -> None:
        """A piece of the row's prompt went in: its states, and the token after each of its positions."""

    def draft(self, row: Request, states) -> mx.array:
        """The row's next drafts after its pending token; `states` those of the places its last verify kept."""


def trim_to(cache: list, length: int) -> None:
    """Cut a drafter's cache back to `length` positions. A draft model whose caches cannot give positions back
    (a sliding window past its size, a recurrent state) is refused at load (runtime/models/families.py); a cache
    that still trims short here ends the row's drafting (the engine's refusal), never drafts made from tokens the
    answer does not hold."""
    cut = cache[0].offset - length
    if trim_prompt_cache(cache, cut) != cut:
        raise RuntimeError(f"the drafter's cache gave back fewer than the {cut} positions asked of it")


def greedy(row: Request, drafts: list[mx.array], logits: mx.array) -> mx.array:
    """The draft after `drafts`: the likeliest token the row's grammar allows there."""
    return mx.argmax(allowed_by(row.grammar, row.said, drafts, logits), axis=-1).astype(mx.uint32)


class Stages:
    """DeepSeek-V4's DSpark stages: the target's taps at each committed position enter the stages' context; a
    row drafts a whole block after its pending token. The tape keeps the taps of a tape's last `keeps`
    positions, so a next turn's context is a prefill's."""

    drafter, who = "dspark", "DSpark's stages"

    def __init__(self, model):
        self._model = model
        self.keeps = dspark.window(model)
        self.arm = getattr(sys.modules[type(model).__module__], "set_dspark_verify_armed", lambda flag: None)

    def width(self, asked: int) -> int:
        return pools.verify_width(asked, int(self._model.args.dspark_block_size), pools.verify_windows(self._model))

    def armed(self, width: int) -> str:
        return f"DSpark's {len(dspark.stages(self._model))} stages, blocks of {width} drafts"

    def context(self, prefix: Prefix) -> list:
        return dspark.context(self._model, prefix.taps, prefix.cached)

    def forward(self, inputs: mx.array, cache: list):
        return self._model(inputs, cache=cache, return_hidden=True)

    def committed(self, row: Request, taps: mx.array) -> None:
        row.recent = dspark.recent(row.recent, taps, self.keeps)

    def prefilled(self, row: Request, taps: mx.array, following: mx.array) -> None:
        self._model.dspark_append_context(taps, row.context)

    def draft(self, row: Request, taps: mx.array) -> mx.array:
        return dspark.draft(self._model, row.context, taps, row.pending, row.width,
                            lambda drafts, logits: allowed_by(row.grammar, row.said, drafts, logits))[0]


class Plain:
    """A proposer that runs the target as it is (its states: none), keeps no taps for the tape, arms nothing and
    learns nothing of a prompt going in; it drafts `widest` a step unless asked for another width."""

    widest: int
    _model: object

    def forward(self, inputs: mx.array, cache: list):
        return self._model(inputs, cache=cache), None

    def width(self, asked: int) -> int:
        return asked or self.widest

    def armed(self, width: int) -> str:
        return f"{self.who}, {width} draft token(s) a step"

    def arm(self, flag: bool) -> None:
        pass

    def committed(self, row: Request, states) -> None:
        pass

    def prefilled(self, row: Request, states, following: mx.array) -> None:
        pass


class Undrafted(Plain):
    """Nobody drafts: each step a row's pending token alone through the target (what `--drafter off` and a model
    with no drafter run)."""

    drafter, who, widest = "", "nobody", 0

    def __init__(self, model):
        self._model = model

    def width(self, asked: int) -> int:
        return 0

    def context(self, prefix: Prefix) -> None:
        return None


class Head(Plain):
    """The model's own multi-token-prediction head (DeepSeek's layout: the target's last hidden state at a
    position and the token after it give a guess at the token after that). The head's cache holds the pairs
    of the row's positions from where its caches began (a prefix the tape gave is not in it: its first drafts
    guess from less); its chained guesses leave it before the next verify's are learned."""

    drafter, who, widest = "mtp", "the model's MTP head", 1

    def __init__(self, model):
        self._model = model

    def context(self, prefix: Prefix) -> list:
        return self._model.make_mtp_cache()

    def forward(self, inputs: mx.array, cache: list):
        hidden = self._model.hidden(inputs, cache)
        return self._model.head(hidden), hidden

    def prefilled(self, row: Request, hidden: mx.array, following: mx.array) -> None:
        """The piece's pairs learned now: a long prompt's hidden states are not held until its first draft."""
        self._learn(row, hidden, following)
        mx.eval([c.state for c in row.context])

    def draft(self, row: Request, hidden: mx.array) -> mx.array:
        """The head learns the verify's kept places (each paired with the token the target sampled there); its
        guess after the last is the first draft, each next one chained from the one before."""
        h, logits = self._learn(row, hidden, mx.array(row.kept, dtype=mx.uint32))
        guesses = [greedy(row, [], logits[:, -1])]
        h = h[:, -1:]
        while len(guesses) < row.width:
            h, logits = self._model.mtp_draft(h, guesses[-1][None], row.context)
            guesses.append(greedy(row, guesses, logits[:, -1]))
        return mx.concatenate(guesses)

    def _learn(self, row: Request, hidden: mx.array, following: mx.array):
        """(hidden state at p, token at p + 1) of the positions just taken, after those the head holds."""
        trim_to(row.context, row.base - hidden.shape[1] - row.cached)
        return self._model.mtp_draft(hidden, following[None], row.context)


class DraftModel(Plain):
    """A small model loaded whole on every rank. Its cache holds a prefix of the row's tape: before drafting it
    takes the rest up to the pending token (a whole prompt, the first time, in chunks), then drafts one token a
    forward; its drafts leave its cache at once."""

    drafter, who, widest = "draft_model", "the draft model", 3

    def __init__(self, model, draft_model, chunk: int = 512):
        self._model = model
        self._draft = draft_model
        self._chunk = chunk

    def context(self, prefix: Prefix) -> list:
        return make_prompt_cache(self._draft)

    def draft(self, row: Request, states) -> mx.array:
        cache = row.context
        held = min(cache[0].offset, row.base)
        trim_to(cache, held)
        behind = row.tape[held:row.base + 1]
        for at in range(0, len(behind), self._chunk):
            logits = self._draft(mx.array(behind[at:at + self._chunk], dtype=mx.uint32)[None], cache=cache)
        guesses = [greedy(row, [], logits[:, -1])]
        while len(guesses) < row.width:
            guesses.append(greedy(row, guesses, self._draft(guesses[-1][None], cache=cache)[:, -1]))
        trim_to(cache, row.base + 1)
        return mx.concatenate(guesses)
