"""Every model family mlx-lm can shard, each built tiny and random from mlx-lm's own classes
(tests/kit/families.py): one pair of ring ranks and one rank alone walk them all through meshd's load path,
and each family's greedy answers are mlx-lm's single process's, and a fresh engine's again through the token
tape, in a batch of four, and drafted by a draft model, alone and three sent at once. Two go through a mesh with
agents and the proxy: qwen3_5 (a recurrent state, ArraysCache) on two nodes and gpt_oss (a sliding window) on
one. A family that cannot run is refused at load, naming why. `bench/models_table.py` writes docs/MODELS.md from
these tests' results."""

import json
import threading

import pytest
import requests

from kit.families import BATCHED, FAMILIES, NEAR_TIE, TOGETHER, Walk, build_family, disagreement, tokens
from kit.meshctl import mesh_up, meshctl
from kit.ranks import start_mesh
from runtime.models.families import PADDING_BLIND, TRIMMABLE, Needs, refusal

WORLDS = (2, 1)
FAMILY = pytest.mark.parametrize("family", list(FAMILIES))
WORLD = pytest.mark.parametrize("world", WORLDS, ids=["TP2", "alone"])


@pytest.fixture(scope="module")
def models(tmp_path_factory, demo_model):
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        build_family(root / family, family, demo_model)
    return root


@pytest.fixture(scope="module")
def matrix(models, draft_model, tmp_path_factory) -> dict:
    """Every family's row at each world, or why that world's walk failed. One walk after the other: two ranks
    that wait on each other busy-poll, and a third process beside them on two cores slows both."""
    tmp = tmp_path_factory.mktemp("walks")
    rows = {}
    for world in WORLDS:
        try:
            rows[world] = Walk(models, draft_model, world, tmp / f"world{world}").rows(timeout=600)
        except AssertionError as e:
            rows[world] = str(e)
    return rows


def row(matrix, family: str, world: int) -> dict:
    """The family's row; a family this node refuses skips, with the refusal as the reason."""
    assert isinstance(matrix[world], dict), matrix[world]
    assert family in matrix[world], f"the walk at world {world} never wrote {family}'s row"
    r = matrix[world][family]
    if "refused" in r:
        pytest.skip(r["refused"])
    return r


def answers(r: dict, scenario: str) -> dict:
    got = r[scenario]
    assert "error" not in got, f"{scenario}: {got['error']}"
    return got


@FAMILY
@WORLD
def test_greedy_answers_are_the_single_process_answers(matrix, family, world):
    """Loaded and sharded through the rank's load path, a fresh engine answers every prompt as mlx-lm's
    greedy decoding of the whole model in one process; at TP2 a flip where the two best tokens lie within
    NEAR_TIE (1e-4) in log probability is TP's summation order, and the answers agree up to it."""
    r = row(matrix, family, world)
    reference = answers(row(matrix, family, 1), "reference")
    fresh = {**answers(r, "fresh"), **answers(r, "fresh_follow_ups")}
    tie = NEAR_TIE if world > 1 else 0.0
    off = {rid: why for rid, a in fresh.items() if (why := disagreement(a, reference[rid], tie))}
    assert not off, off


@FAMILY
@WORLD
def test_the_tape_answers_as_a_fresh_engine(matrix, family, world):
    """After p1, the same prompt again, one sharing p1's first 12 tokens and one extending p1's answer: each
    answered exactly as a fresh engine answers it, whatever the tape kept (a sliding window past its size, a
    recurrent state)."""
    r = row(matrix, family, world)
    fresh = {**answers(r, "fresh"), **answers(r, "fresh_follow_ups")}
    taped = answers(r, "tape")
    assert {rid: tokens(a) for rid, a in taped.items()} == \
           {rid: tokens(fresh["p1" if rid == "again" else rid]) for rid in taped}


@FAMILY
@WORLD
def test_four_concurrent_requests_answer_as_each_alone(matrix, family, world):
    """p1 alone for its prefill and first token, then three more join it: each answer is the one it gets
    alone. A family that answers differently in a batch is served one request at a time, as its refusal
    says, and answers as alone that way."""
    r = row(matrix, family, world)
    fresh = answers(r, "fresh")
    batch = answers(r, "batch")
    assert {rid: tokens(a) for rid, a in batch.items()} == {rid: tokens(fresh[rid]) for rid in BATCHED}


@pytest.mark.parametrize("family", sorted(PADDING_BLIND))
def test_a_family_served_one_at_a_time_does_answer_otherwise_in_a_batch(matrix, family):
    """What the one-at-a-time refusal spares a client (runtime.models.families.PADDING_BLIND): batched, some
    answer changes; every other family batches exactly (the test above)."""
    r = row(matrix, family, 1)
    assert r["batch_size"] == 1, "a padding-blind family is served one request at a time"
    fresh, anyway = answers(r, "fresh"), answers(r, "batched_anyway")
    assert any(tokens(anyway[rid]) != tokens(fresh[rid]) for rid in BATCHED), r["one_at_a_time"]


@FAMILY
@WORLD
def test_drafted_answers_are_the_plain_answers(matrix, family, world):
    """With a draft model (speculative decoding) greedy answers are plain decoding's, whatever the family's caches
    (a verify's writes undone exactly: runtime/prefix/rollback.py)."""
    r = row(matrix, family, world)
    drafted = r["speculative"]
    if "refused" in drafted:
        pytest.skip(drafted["refused"])
    fresh = answers(r, "fresh")
    assert {rid: tokens(a) for rid, a in answers(r, "speculative").items()} == \
           {rid: tokens(fresh[rid]) for rid in drafted}


@FAMILY
@WORLD
def test_prompts_sent_together_go_in_together_and_answer_as_each_alone(matrix, family, world):
    """p1 and p5, as long, and p2 sent at once to the drafting engine: p1's and p5's prompts go in in one forward
    (their caches merged for it and taken back out, whatever the family's caches are), p2's apart; each answer
    is the one it gets alone. A family served one request at a time has no caches merged."""
    r = row(matrix, family, world)
    got, fresh = answers(r, "drafted_together"), answers(r, "fresh")
    assert {rid: tokens(got[rid]) for rid in TOGETHER} == {rid: tokens(fresh[rid]) for rid in TOGETHER}
    assert (["p1", "p5"] in got["went_in"]) == (r["batch_size"] > 1), got["went_in"]


def test_families_whose_caches_a_trim_cannot_cut_back_are_drafted(matrix):
    """A sliding window past its size and a recurrent state cannot give back a rejected draft by a trim; drafting
    no longer refuses them: some family of each kind was drafted alone, its answers plain decoding's."""
    assert isinstance(matrix[1], dict), matrix[1]
    drafted: dict[str, bool] = {}
    for r in matrix[1].values():
        if isinstance(r.get("speculative"), dict) and "refused" not in r["speculative"] and "caches" in r:
            fresh, said = answers(r, "fresh"), answers(r, "speculative")
            exact = all(tokens(a) == tokens(fresh[rid]) for rid, a in said.items())
            for kind in set(r["caches"]) - TRIMMABLE:
                drafted[kind] = drafted.get(kind, False) or exact
    assert {"RotatingKVCache", "ArraysCache"} <= drafted.keys() and all(drafted.values()), drafted


def test_a_family_that_cannot_run_here_is_refused_at_load_naming_why(matrix, models, tmp_path):
    """Two real meshd-rank processes of a family this node refuses both exit 1 at load with the walk's reason
    (the same check), neither left waiting for the other."""
    refused = {f: r["refused"] for f, r in matrix[2].items() if "refused" in r}
    if not refused:
        pytest.skip("every family runs on this node")
    family, why = next(iter(refused.items()))
    with start_mesh(models / family, 2, tmp_path) as mesh:
        assert mesh.wait_exit(120) == [1, 1], mesh.log(0)
        assert all(why in mesh.log(rank) for rank in (0, 1))


def chat(proxy: str, messages: list[dict]) -> dict:
    r = requests.post(f"{proxy}/chat/completions", timeout=120,
                      json={"messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("family,nodes", [("qwen3_5", 2), ("gpt_oss", 1)])
def test_through_agents_and_the_proxy_answers_are_the_single_process_answers(models, family, nodes, tmp_path):
    """A mesh of `nodes` agents serving the family: a conversation's first turn, the same again, another
    question after the same system prompt, its next turn, and four questions at once, each answered as mlx-lm's
    single process answers it."""
    from mlx_lm import load
    from mlx_lm.generate import generate

    model, tokenizer = load(str(models / family))

    def alone(messages: list[dict]) -> str:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return generate(model, tokenizer, ids, max_tokens=8, verbose=False)

    system = {"role": "system", "content": "You are a mesh of machines. " * 3}
    first = [system, {"role": "user", "content": "hello world"}]
    with mesh_up(tmp_path, models / family, nodes) as (config, _):
        proxy = json.loads(meshctl(config, "status", "--json").stdout)["urls"]["proxy"]
        said = chat(proxy, first)["choices"][0]["message"]["content"]
        assert said == alone(first)
        again = chat(proxy, first)
        assert again["choices"][0]["message"]["content"] == said
        other = [system, {"role": "user", "content": "What is the answer?"}]
        assert chat(proxy, other)["choices"][0]["message"]["content"] == alone(other)
        turn = first + [{"role": "assistant", "content": said}, {"role": "user", "content": "and then?"}]
        assert chat(proxy, turn)["choices"][0]["message"]["content"] == alone(turn)

        questions = [[{"role": "user", "content": q}] for q in ("one", "The quick brown fox", "2 + 2 =", "Drain")]
        got: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i, q=q: got.__setitem__(i, chat(proxy, q)["choices"][0]
                                                                          ["message"]["content"]))
                   for i, q in enumerate(questions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == {i: alone(q) for i, q in enumerate(questions)}


@pytest.mark.parametrize("ours,theirs,tie,off", [
    ([[5, [[5, -1.0], [7, -2.0]]]], [[5, [[5, -1.0], [7, -2.0]]]], 0.0, None),
    ([[5, [[5, -1.0], [7, -1.00005]]], [9, []]], [[7, [[7, -1.0], [5, -1.00001]]], [2, []]], 1e-4, None),
    ([[5, [[5, -1.0], [7, -1.00005]]]], [[7, [[7, -1.0], [5, -1.00001]]]], 0.0, "token 0: 5"),
    ([[5, [[5, -1.0], [7, -1.5]]]], [[7, [[7, -1.0], [5, -1.2]]]], 1e-4, "token 0: 5"),
    ([[5, [[5, -1.0], [8, -1.0]]]], [[7, [[7, -1.0], [9, -1.0]]]], 1e-4, "token 0: 5"),  # not each other's second
    ([[5, []]], [[5, []], [6, []]], 1e-4, "1 tokens where the other run said 2"),
])
def test_answers_disagree_beyond_a_near_tie(ours, theirs, tie, off):
    why = disagreement(ours, theirs, tie)
    assert why == off if off is None else why.startswith(off)


KV, SLIDING, STATE = frozenset({"KVCache"}), frozenset({"KVCache", "RotatingKVCache"}), frozenset({"ArraysCache"})


@pytest.mark.parametrize("needs,asked,refused", [
    (Needs("llama"), {}, None),
    (Needs("muse_spark", ("qk_norm",)), {}, "Metal-only kernels (qk_norm)"),
    (Needs("muse_spark", ("qk_norm",)), {"metal": True}, None),
    (Needs("gpt_oss", caches=SLIDING), {}, None),
    (Needs("gpt_oss", caches=SLIDING), {"draft": Needs("llama")}, None),  # a verify's writes undone exactly
    (Needs("qwen3_5", caches=STATE), {"draft": Needs("llama")}, None),
    (Needs("llama"), {"draft": Needs("qwen3_5", caches=STATE)}, "the draft model's ArraysCache cannot give back"),
    (Needs("deepseek_v41", caches=frozenset({"LayerCache"}), unbatchable=frozenset({"LayerCache"})), {},
     "their LayerCache cannot be merged in this mlx-lm; serve one request at a time: --completion-batch-size 1"),
    (Needs("deepseek_v41", caches=frozenset({"LayerCache"}), unbatchable=frozenset({"LayerCache"})), {"batch": 1},
     None),  # a batch of one row never merges its caches
    (Needs("deepseek_v41", caches=frozenset({"LayerCache"}), unbatchable=frozenset({"LayerCache"})),
     {"draft": Needs("llama")}, "--completion-batch-size 1"),
    (Needs("minimax_m3_vl", caches=KV), {}, "--completion-batch-size 1"),
    (Needs("minimax_m3_vl", caches=KV), {"batch": 1}, None),
    (Needs("minimax_m3_vl", caches=KV), {"draft": Needs("llama")}, "--completion-batch-size 1"),  # rows pad too
    (Needs("minimax_m3_vl", caches=KV), {"draft": Needs("llama"), "batch": 1}, None),
])
def test_what_a_family_needs_decides_whether_it_runs(needs, asked, refused):
    why = refusal(needs, **{"metal": False, **asked})
    assert why == refused if refused is None else refused in why
