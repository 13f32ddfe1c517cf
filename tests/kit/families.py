"""Every model family mlx-lm 0.32.2 can `shard()`, as a tiny random model directory built from mlx-lm's own
model classes, and the walk one rank makes through all of them (`python -m kit.families`, started the way the
agent starts a rank): load and shard each through meshd's load path, then answer the same greedy prompts
fresh, through the token tape, batched and drafted, writing what came out."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from common.hostfile import launch_env
from kit.agents import ring_hostfile
from meshd.meshctl.ports import free_run

V = 512  # the model's vocabulary: the demo tokenizer's 508 tokens and spare rows, even for a vocab split
WINDOW = 8  # sliding windows: every prompt below is longer, so a rotating cache is past it after the prefill
BASE = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=4096,
            rope_theta=10000.0, tie_word_embeddings=False)
MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
DEEPSEEK_MOE = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                    n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True)
YARN = {"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 1024}
SLIDING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
LONGCAT = dict(ffn_hidden_size=128, moe_topk=2, expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=2,
               num_layers=2, routed_scaling_factor=1.0, mla_scale_q_lora=True, mla_scale_kv_lora=True)

# config.json of each family (model_type added below): two layers of each kind the family mixes, heads and
# experts that split in two, the real configs' switches where a family has several paths.
FAMILIES: dict[str, dict] = {
    "llama": {**BASE, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": WINDOW},
    "qwen2": BASE,
    "qwen3": BASE,
    "qwen3_moe": {**BASE, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                  "mlp_only_layers": [0], "moe_intermediate_size": 32, "norm_topk_prob": True},
    "qwen3_5": {**BASE, "full_attention_interval": 2, "linear_num_value_heads": 4,
                "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4, "rope_parameters": {"type": "default", "rope_theta": 10000.0,
                                                                 "partial_rotary_factor": 0.5,
                                                                 "mrope_section": [2, 1, 1]}},
    "deepseek_v2": {**BASE, **MLA, **DEEPSEEK_MOE, "topk_method": "greedy", "rope_scaling": YARN},
    "deepseek_v3": {**BASE, **MLA, **DEEPSEEK_MOE, "rope_scaling": YARN},
    "deepseek_v32": {**BASE, **MLA, **DEEPSEEK_MOE, "index_head_dim": 16, "index_n_heads": 4, "index_topk": 4},
    "deepseek_v41": {**BASE, "head_dim": 32, "q_lora_rank": 16, "qk_rope_head_dim": 8, "o_groups": 2,
                     "o_lora_rank": 16, "moe_intermediate_size": 32, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "sliding_window": WINDOW, "compress_ratios": [0, 4],
                     "kv_source_layer_ids": [1], "index_source_layer_ids": [1], "index_n_heads": 4,
                     "index_head_dim": 16, "index_topk": 4, "hc_mult": 2, "hc_sinkhorn_iters": 3},
    "glm4_moe": {**BASE, **DEEPSEEK_MOE, "use_qk_norm": True, "attention_bias": False,
                 "partial_rotary_factor": 0.5, "rope_scaling": None},
    "glm4_moe_lite": {**BASE, **MLA, **DEEPSEEK_MOE, "num_key_value_heads": 4},
    "gpt_oss": {**BASE, **SLIDING, "num_local_experts": 4, "num_experts_per_tok": 2},
    "minimax": {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 0,
                "rotary_dim": 8},
    "ministral3": {**BASE, **SLIDING, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                          "llama_4_scaling_beta": 0.1,
                                                          "original_max_position_embeddings": 4096}},
    "mistral4": {**BASE, **MLA, **DEEPSEEK_MOE, "rope_parameters": {**YARN, "rope_type": "yarn",
                                                                   "rope_theta": 10000.0,
                                                                   "llama_4_scaling_beta": 0.1}},
    "exaone_moe": {**BASE, **SLIDING, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                   "num_shared_experts": 1, "is_moe_layer": [False, True]},
    "iquestloopcoder": {**BASE, "loop_num": 2, "loop_window_size": WINDOW},
    "step3p5": {**BASE, **SLIDING, "num_attention_groups": 2, "moe_num_experts": 4, "moe_top_k": 2,
                "moe_intermediate_size": 32, "share_expert_dim": 32, "moe_layers_enum": "1"},
    "kimi_k25": {"text_config": {**BASE, **MLA, **DEEPSEEK_MOE, "model_type": "deepseek_v3"}},
    "kimi_k3": {"text_config": {**BASE, **MLA, "model_type": "kimi_linear", "num_experts": 4,
                                "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 32,
                                "first_k_dense_replace": 1,
                                "linear_attn_config": {"kda_layers": [1], "num_heads": 4, "head_dim": 16,
                                                       "short_conv_kernel_size": 4}}},
    "longcat_flash": {**BASE, **MLA, **LONGCAT, "attention_method": "MLA", "zero_expert_type": "identity",
                      "attention_bias": False},
    "longcat_flash_ngram": {**BASE, **MLA, **LONGCAT, "ngram_vocab_size_ratio": 2},
    "minimax_m3_vl": {"text_config": {**BASE, "intermediate_size": 32, "dense_intermediate_size": 128,
                                      "shared_intermediate_size": 32, "num_local_experts": 4,
                                      "num_experts_per_tok": 2, "partial_rotary_factor": 0.5,
                                      "mlp_layer_types": ["dense", "sparse"],
                                      "layer_types": ["full_attention", "minimax_m3_sparse"], "index_n_heads": 2,
                                      "index_head_dim": 16, "index_block_size": 4, "index_topk_blocks": 2}},
    "muse_spark": {"text_config": {**BASE, **SLIDING, "post_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 1e4},
                                   "layer_rope_theta": [10000.0, 0], "final_logit_softcapping": 30.0,
                                   "output_multiplier": 1.0, "num_local_experts": 4, "num_experts_per_tok": 2,
                                   "moe_hidden_size": 32, "moe_intermediate_size": 32},
                   "audio_config": {"out_hidden_size": 64}},
}
FAMILIES = {name: {**config, "model_type": name} for name, config in FAMILIES.items()}


def build_family(path: Path, family: str, tokenizer: Path) -> Path:
    """The family's tiny model in mlx-lm's format at `path`: its config, seeded random weights (embeddings and
    head scaled up, as the demo model's, so greedy answers have clear winners and vary), and the tokenizer of
    the model directory `tokenizer`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, path / name)
    eos = json.loads((tokenizer / "config.json").read_text())["eos_token_id"]
    config = {**FAMILIES[family], "eos_token_id": eos, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    weights = {k: v * 4.0 if k.endswith(("lm_head.weight", "embed_tokens.weight")) else v
               for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


# --- the walk, on every rank alike --------------------------------------------------------------------------
ANSWER = 5  # tokens an answer runs to (fewer where the model says its end of sequence)
BATCH = 16  # meshd-rank's --completion-batch-size by default
TOP = 2  # alternatives recorded per token: a greedy flip between TP and one process shows as a near-tie


def prompt(seed: int, n: int) -> list[int]:
    """`n` token ids, none of the tokenizer's special ones (0-2)."""
    return [3 + (seed * 7919 + i * 104729) % (V - 8) for i in range(n)]


PROMPTS = {"p1": prompt(1, 20), "p2": prompt(2, 13), "p3": prompt(3, 24), "p4": prompt(4, 9), "p5": prompt(7, 20)}
BATCHED = ("p1", "p2", "p3", "p4")  # the batch engine's: p1 alone first, the others joining it
TOGETHER = ("p1", "p5", "p2")  # sent at once to the drafting engine: p1 and p5, as long, go in together


def follow_ups(first_answer: list[int]) -> dict[str, list[int]]:
    """Prompts after p1: one sharing p1's first 12 tokens, and p1 with its answer and more."""
    p1 = PROMPTS["p1"]
    return {"partial": p1[:12] + prompt(5, 6), "extended": p1 + first_answer + prompt(6, 5)}


def answer(engine, jobs: dict[int, list]) -> dict[str, list]:
    """Step `engine` until every job is answered, inserting each list of jobs at its step; each job's tokens
    as [token, [[alternative, log probability], ...]]."""
    out: dict[str, list] = {}
    step = 0
    while engine.busy or any(s >= step for s in jobs):
        for job in jobs.get(step, []):
            engine.insert(job)
        for e in engine.step():
            if e.token is not None:
                out.setdefault(e.rid, []).append([e.token, [list(t) for t in e.top]])
        step += 1
    return out


def walk(path: Path, group, draft_path: Path, draft) -> dict:
    """One family's row on this rank: what each scenario answered, or why the family or a scenario cannot run."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_config

    from runtime.models import families
    from kit.drafters import drafting, undrafted
    from runtime.engine.proposers import DraftModel
    from runtime.engine.jobs import Job
    from runtime.prefix.store import PrefixStore
    from common.openai_api import SamplingParams
    from runtime.rank import load_sharded

    config = load_config(path)
    row: dict = {"family": path.name, "world": group.size(), "batch_size": BATCH}
    try:
        families.refuse(config, draft=None, batch=BATCH)
    except SystemExit as e:
        try:  # refused as batched: what the refusal names as the way out, if it is one
            families.refuse(config, draft=None, batch=1)
        except SystemExit:
            return {**row, "refused": str(e)}
        row.update(batch_size=1, one_at_a_time=str(e))
    row["caches"] = sorted(families.needs_of(config).caches)
    model = load_sharded(path, group, lambda done, total: None)
    eos = {config["eos_token_id"]}
    greedy = SamplingParams(ANSWER).sampling()

    def job(rid: str, tokens: list[int]) -> Job:
        return Job(rid, tuple(tokens), ANSWER, 0, greedy, logprobs=TOP)

    def scenario(name: str, run) -> None:
        try:
            row[name] = run()
        except SystemExit as e:
            row[name] = {"refused": str(e)}
        except Exception as e:  # the same on every rank: the walk goes on to the next scenario
            row[name] = {"error": f"{type(e).__name__}: {e}"[:500]}

    def engine(tape: bool = False, batch: int = row["batch_size"]):
        return undrafted(model, eos, completion_batch_size=batch,
                           prefixes=PrefixStore(model, tape_capacity=8 if tape else 0))

    def alone(prompts: dict) -> dict:
        e = engine()
        return {rid: answer(e, {0: [job(rid, p)]})[rid] for rid, p in prompts.items()}

    def taped() -> dict:
        """p1, then p1 again and the follow-ups, on one engine whose tape keeps what each left."""
        e = engine(tape=True)
        prompts = {"p1": PROMPTS["p1"], "again": PROMPTS["p1"], **cases}
        return {rid: answer(e, {0: [job(rid, p)]})[rid] for rid, p in prompts.items()}

    def batched(batch: int = row["batch_size"]) -> dict:
        """p1 alone for two steps (its prefill and first token), then the other three join it."""
        first, *later = (job(rid, PROMPTS[rid]) for rid in BATCHED)
        return answer(engine(batch=batch), {0: [first], 2: later})

    def drafted() -> dict:
        families.refuse(config, draft=str(draft_path), batch=1)
        e = drafting(model, eos, DraftModel(model, draft), num_draft_tokens=2)
        out = answer(e, {0: [job("p1", PROMPTS["p1"])]})
        if e.fallbacks:  # a drafted step raised; the engine went on undrafted (runtime/engine/rowwise.py)
            out["error"] = f"{e.fallbacks} drafted step(s) raised and fell back to plain decoding"
        return out

    def drafted_together() -> dict:
        """TOGETHER sent at once to the drafting engine, with what each of its prefill forwards took in."""
        families.refuse(config, draft=str(draft_path), batch=1)
        e = drafting(model, eos, DraftModel(model, draft), num_draft_tokens=2, completion_batch_size=row["batch_size"])
        went, prefill = [], e._prefill
        e._prefill = lambda rows, n: went.append([r.rid for r in rows]) or prefill(rows, n)
        return {**answer(e, {0: [job(rid, PROMPTS[rid]) for rid in TOGETHER]}), "went_in": went}

    def reference(prompts: dict) -> dict:
        """mlx-lm's own greedy decoding of the unsharded model, as [token, top] like the engines'."""
        out = {}
        for rid, p in prompts.items():
            out[rid] = []
            for token, logprobs in generate_step(mx.array(p), model, max_tokens=ANSWER):
                top = mx.argsort(-logprobs)[:TOP].tolist()
                out[rid].append([int(token), [[t, logprobs[t].item()] for t in top]])
                if token in eos:
                    break
        return out

    scenario("fresh", lambda: alone(PROMPTS))
    cases = follow_ups(tokens(row["fresh"].get("p1", [])))
    scenario("fresh_follow_ups", lambda: alone(cases))
    scenario("tape", taped)
    scenario("batch", batched)
    scenario("speculative", drafted)
    scenario("drafted_together", drafted_together)
    if group.size() == 1:
        scenario("reference", lambda: reference({**PROMPTS, **cases}))
        if row["batch_size"] == 1:  # what the refusal spares a client
            scenario("batched_anyway", lambda: batched(BATCH))
    return row


# --- what the test reads of the walk -------------------------------------------------------------------------
NEAR_TIE = 1e-4  # log probability: TP2's float32 sums differ from one process's by ~5e-6 on these models


def tokens(answer: list) -> list[int]:
    return [t for t, _ in answer]


def disagreement(ours: list, theirs: list, tie: float) -> str | None:
    """Where answer `ours` first departs from `theirs` beyond a near-tie (None: equal, or equal up to a token
    both runs rank within `tie` of each other, after which the answers may go their own ways)."""
    for i, ((mine, top), (other, their_top)) in enumerate(zip(ours, theirs)):
        if mine != other:
            mine_lp, other_lp = dict(top), dict(their_top)
            if other in mine_lp and mine in other_lp and abs(mine_lp[mine] - mine_lp[other]) <= tie:
                return None
            return f"token {i}: {mine} (top {top}) where the other run said {other} (top {their_top})"
    return None if len(ours) == len(theirs) else f"{len(ours)} tokens where the other run said {len(theirs)}"


class Walk:
    """The ranks of one walk through the families, started as the agent starts ranks (common.hostfile's
    launch_env on a ring hostfile of loopback hosts); their rows once all have exited."""

    def __init__(self, models: Path, draft: Path, world: int, tmp: Path):
        tmp.mkdir(parents=True, exist_ok=True)
        self.out, self.logs, self.procs = tmp / "rows.jsonl", [], []
        port = free_run(world)
        for rank in range(world):
            launch = launch_env(ring_hostfile(world), rank, starting_port=port)
            env = {**os.environ, **launch.env, "MESHD_BACKEND": "ring", "PYTHONUNBUFFERED": "1"}
            for var, content in launch.files.items():
                (tmp / var).write_text(content + "\n")
                env[var] = str(tmp / var)
            self.logs.append(tmp / f"rank-{rank}.log")
            with open(self.logs[-1], "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kit.families", "--models", str(models), "--draft", str(draft),
                     "--out", str(self.out)], cwd=Path(__file__).parents[1], env=env, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True))

    def rows(self, timeout: float) -> dict[str, dict]:
        """The rows, or an AssertionError with the log of the rank that failed or outlasted `timeout`."""
        try:
            for p, log in zip(self.procs, self.logs):
                try:
                    code = p.wait(timeout)
                    failed = f"exited {code}" if code else None
                except subprocess.TimeoutExpired:
                    failed = f"still ran after {timeout}s"
                if failed:
                    raise AssertionError(f"a rank of the walk {failed}:\n{log.read_text()[-3000:]}")
        finally:
            for p in self.procs:
                p.kill()
        return {row["family"]: row for row in map(json.loads, self.out.read_text().splitlines())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Walk the family models as one rank; rank 0 writes the rows")
    p.add_argument("--models", type=Path, required=True, help="a directory of family model directories")
    p.add_argument("--draft", type=Path, required=True, help="a draft model for speculative decoding")
    p.add_argument("--out", type=Path, required=True, help="JSON lines, one row per family (rank 0)")
    p.add_argument("families", nargs="*", default=list(FAMILIES))
    args = p.parse_args(argv)

    from mlx_lm.utils import load_model

    from runtime.join import join_mesh

    group = join_mesh()
    draft = load_model(args.draft)[0]
    for family in args.families:
        row = walk(args.models / family, group, args.draft, draft)
        if group.rank() == 0:
            with open(args.out, "a") as out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
