"""meshd's omlx adapter on omlx's own DeepSeek-V4 (flyto-mlx's, at its pins) with a checkpoint whose MTP is the
V3-shaped head (e_proj/h_proj), not DSpark: at TP2 the ranks serve undrafted and say in one line why and how to
get a DSpark checkpoint, both on omlx as published (no DSpark at all) and on an omlx that has DSpark (the
stand-in's stages: there the load used to split the V3 head as DSpark's stages and crash); omlx's own drafting
of a lone row (its patch of mlx-lm's GenerationBatch.next, which no other rank joins, and which at this
version raises on its own DeepSeek-V4) stays off for a model meshd loaded, even in mlx-lm's BatchGenerator
(meshd's engine does not use it), while the same model loaded without meshd's adapter would take it."""

import mlx.core as mx
import pytest
import requests
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load_model

from common.openai_api import SamplingParams
from kit.ranks import start_mesh
from pinned.dsv4 import build_v4_checkpoint, pinned_env
from runtime.models import dspark
from kit.drafters import undrafted
from runtime.engine.jobs import Job
from runtime.models.overlay import OMLX, set_up
from runtime.rank import load_sharded

set_up(OMLX)
from omlx.patches import mlx_lm_mtp
from omlx.patches.mlx_lm_mtp import batch_generator

PROMPT = tuple(range(40, 140))
GREEDY = SamplingParams(max_tokens=1).sampling()
NO_STAGES = f"the checkpoint holds a V3-shaped MTP head (e_proj/h_proj), not DSpark's stages; {OMLX.draft_fix}"
PUBLISHED = ("this omlx has no drafter for it (it lacks dspark_append_context, dspark_forward, dspark_markov) and "
             f"the checkpoint holds a V3-shaped MTP head (e_proj/h_proj); {OMLX.fix}, and {OMLX.draft_fix}")


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory):
    return build_v4_checkpoint(tmp_path_factory.mktemp("models") / "v4-mtp", mtp="v3")


@pytest.mark.parametrize("omlx, said", [({}, PUBLISHED), (None, NO_STAGES)], ids=["published", "with-dspark"])
def test_a_v3_shaped_mtp_serves_undrafted_at_tp2_and_says_why(v3_checkpoint, tmp_path, omlx, said):
    env = pinned_env() if omlx is None else omlx  # the stand-in's stages on the ranks' path, or omlx as published
    with start_mesh(v3_checkpoint, 2, tmp_path, "--model-package", "omlx", env=env) as mesh:
        mesh.wait_ready(300)
        r = requests.post(f"{mesh.url}/v1/chat/completions", timeout=300,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        logs = [mesh.log(0), mesh.log(1)]
    assert r.status_code == 200, r.text
    assert all(f"drafter off, serving undrafted: {said}" in log for log in logs), logs[0]
    assert all("drafter armed" not in log for log in logs)


class Engaged:
    """Counts the steps omlx's GenerationBatch patch takes its own MTP path for, while in force; each falls
    back to mlx-lm's step (the way omlx's own fallback does), since at flyto-mlx 0.7.0 that path raises on its
    own DeepSeek-V4 (`__call__() got an unexpected keyword argument 'n_confirmed'`)."""

    def __enter__(self):
        self.steps, self._next = 0, batch_generator._mtp_next

        def engaged(*args, **kwargs):
            self.steps += 1
            raise batch_generator._MtpStepFallback("counted")

        batch_generator._mtp_next = engaged
        return self

    def __exit__(self, *exc):
        batch_generator._mtp_next = self._next


def answer(model) -> list[int]:
    """meshd's engine's answer to a long request sent with a short one."""
    engine = undrafted(model, {1})
    engine.insert(Job("a", PROMPT, 12, 0, GREEDY))
    engine.insert(Job("b", PROMPT[:50], 2, 0, GREEDY))
    tokens = []
    while engine.busy:
        tokens += [e.token for e in engine.step() if e.token is not None and e.rid == "a"]
    return tokens


def batched(model) -> None:
    """The same two requests on mlx-lm's BatchGenerator, which omlx patches: the long answer goes on alone in its
    GenerationBatch once the short one ends."""
    gen = BatchGenerator(model, stop_tokens=[[1]], sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
    long, _ = gen.insert([list(PROMPT), list(PROMPT[:50])], max_tokens=[12, 2])
    try:
        while not any(g.uid == long and g.finish_reason for g in gen.next()[1]):
            pass
    finally:
        gen.close()


def test_omlxs_own_drafting_of_a_lone_row_is_off_under_meshd(v3_checkpoint):
    said = []
    mlx_lm_mtp.set_mtp_active(True)  # as the adapter's setup leaves it before load
    model = load_sharded(v3_checkpoint, mx.distributed.init(), lambda done, total: None, OMLX, said.append)
    assert said == [f"drafter off, serving undrafted: {NO_STAGES}"]
    assert model.mtp and not dspark.stages(model)  # omlx loaded its V3 head; no stage to split or draft with
    assert len(answer(model)) == 12  # meshd's engine decodes it, and no BatchGenerator of omlx's is in its way
    with Engaged() as meshd:
        batched(model)
    mlx_lm_mtp.set_mtp_active(True)
    bare, _ = load_model(v3_checkpoint)  # the same checkpoint loaded as omlx alone loads it
    with Engaged() as alone:
        batched(bare)
    assert meshd.steps == 0  # the adapter switched omlx's drafting off: not even its own BatchGenerator takes it
    assert alone.steps > 0  # omlx would draft the row left alone by itself, no other rank agreeing
    assert not mlx_lm_mtp.model_mtp_active(model)
