"""The grammar cache's bound in bytes and the cost rule that refuses a grammar before it is compiled (table tests),
and the compiler that keeps them (one process, the demo model's tokenizer)."""

import psutil
import pytest

from common.grammars import MAX_GRAMMAR_BYTES, UNSERVED, GrammarError, asks_for_grammar, too_costly
from runtime.engine import grammar
from runtime.engine.grammar import ByteBoundCache


@pytest.mark.parametrize("puts, budget, kept, nbytes", [
    ([("a", 40), ("b", 40)], 100, ["a", "b"], 80),  # within the budget: both stay
    ([("a", 40), ("b", 40), ("c", 40)], 100, ["b", "c"], 80),  # the oldest goes
    ([("a", 40), ("b", 40), ("a", None), ("c", 40)], 100, ["a", "c"], 80),  # a read makes it recent
    ([("a", 10), ("b", 10), ("c", 95)], 100, ["c"], 95),  # one big one evicts several
    ([("a", 10), ("big", 500)], 100, ["big"], 500),  # the newest stays even alone past the budget
    ([("a", 10), ("big", 500), ("b", 10)], 100, ["b"], 10),  # ... until the next
    ([("a", 30), ("a", 60)], 100, ["a"], 60),  # a key put again counts once, at its new size
])
def test_the_cache_keeps_the_most_recent_within_its_bytes(puts, budget, kept, nbytes):
    cache = ByteBoundCache(budget)
    for key, size in puts:
        if size is None:
            assert cache.get(key) == f"value of {key}"
        else:
            cache.put(key, f"value of {key}", size)
    assert [k for k in ("a", "b", "c", "big") if cache.get(k) is not None] == kept
    assert cache.nbytes == nbytes and len(cache) == len(kept)


def test_put_says_what_it_evicted():
    cache = ByteBoundCache(100)
    assert cache.put("a", 1, 60) == []
    assert cache.put("b", 2, 60) == ["a"]


@pytest.mark.parametrize("size, refused", [(100, False), (MAX_GRAMMAR_BYTES, False), (MAX_GRAMMAR_BYTES + 1, True)])
def test_a_grammar_past_the_limit_is_too_costly_with_its_size_and_the_fix(size, refused):
    why = too_costly("x" * size)
    assert (why is not None) == refused
    if refused:
        assert f"{size // 1024} KiB" in why and "shorten its enums" in why


def enum_schema(values: int, tag: object = "") -> dict:
    return {"type": "object", "properties": {"k": {"enum": [f"value-{tag}-{i}-abcdefgh" for i in range(values)]}}}


@pytest.mark.parametrize("values, refused", [(50, False), (3000, False), (20000, True)])
def test_a_schema_of_a_huge_enum_is_refused_before_it_is_compiled(values, refused):
    if not refused:
        assert UNSERVED.json(enum_schema(values))
        return
    with pytest.raises(GrammarError, match="KiB of grammar meshd compiles"):
        UNSERVED.json(enum_schema(values))


def test_forced_calls_with_huge_parameters_are_refused_too():
    tool = {"type": "function", "function": {"name": "pick", "parameters": enum_schema(20000)}}
    with pytest.raises(GrammarError, match="KiB of grammar meshd compiles"):
        UNSERVED.tool_calls([tool], several=False)


@pytest.mark.parametrize("body, asks", [
    ({"messages": []}, False),
    ({"response_format": {"type": "text"}}, True),  # checked off the loop too: cheap either way
    ({"tool_choice": "auto", "tools": []}, False),
    ({"tool_choice": "none"}, False),
    ({"tool_choice": "required"}, True),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, True),
    ([], False),
])
def test_which_bodies_may_hold_their_answer_to_a_grammar(body, asks):
    assert asks_for_grammar(body) == asks


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer
    from runtime.models.demo_model import build_demo_model
    return load_tokenizer(build_demo_model(tmp_path_factory.mktemp("demo") / "model"))


def test_many_distinct_schemas_keep_the_cache_and_the_process_within_the_bound(tokenizer):
    """Each 3,000-value enum's compiled grammar holds a megabyte or more: 24 of them unbounded would grow the
    process by tens of megabytes; within a 6 MB cache it grows by about that."""
    grammar.serve(tokenizer, cache_bytes=6 << 20)
    texts = [grammar.builder().json(enum_schema(3000, tag=i)) for i in range(25)]
    grammar.prepare(texts[0]).result()
    before = psutil.Process().memory_info().rss
    for text in texts[1:]:
        grammar.prepare(text).result()
    grown = psutil.Process().memory_info().rss - before
    stats = grammar.stats()
    print(stats, f"grown {grown >> 20} MB")
    assert stats["grammar_cache_bytes"] <= 6 << 20 and 1 < stats["grammars_cached"] < 24, stats
    assert grown < 16 << 20, f"the process grew {grown >> 20} MB past a cache of 6 MB"


def test_a_grammar_asked_for_at_once_by_several_compiles_once(tokenizer):
    grammar.serve(tokenizer)
    text = grammar.UNSERVED.json(enum_schema(2000, tag="once"))
    futures = [grammar.prepare(text) for _ in range(8)]
    assert all(f is futures[0] for f in futures)
    first = futures[0].result()
    assert grammar.prepare(text).result() is first and grammar.stats()["grammars_cached"] == 1
