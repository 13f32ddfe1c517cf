"""Held answers wait for their grammar on every rank (runtime/compiles.py): two ranks' Compiles driven through
their messages and agreements, each rank's compiles as futures the test completes."""

from concurrent.futures import Future

import pytest

from common.grammars import GrammarError
from common.openai_api import SamplingParams
from runtime.compiles import Compiles
from runtime.engine.jobs import Job
from runtime.lockstep import Cancel, CompileGrammar, Drain, DrainMode, Insert


def insert(rid: str, grammar: str | None = None) -> Insert:
    sampling = SamplingParams(max_tokens=4).sampling()
    sampling["grammar"] = grammar
    return Insert(Job(rid, (1, 2), 4, 0, sampling))


class Mesh:
    """Two ranks' Compiles; `compiles[rank][text]` is that rank's compile of `text`."""

    def __init__(self):
        self.failed: list[str] = []
        self.compiles: list[dict[str, Future]] = [{}, {}]
        self.ranks = [Compiles(lambda rid, why: self.failed.append(rid), self._prepare(0)),
                      Compiles(None, self._prepare(1))]

    def _prepare(self, rank: int):
        return lambda text: self.compiles[rank].setdefault(text, Future())

    def iteration(self, outbox: list) -> list:
        """One loop iteration: rank 0 screens its outbox, every rank applies the messages, then they agree."""
        sent = self.ranks[0].screen(outbox)
        for rank in self.ranks:
            for msg in sent:
                if isinstance(msg, CompileGrammar):
                    rank.start(msg.grammar)
        if self.ranks[0].pending:
            offers = [rank.offer() for rank in self.ranks]
            for rank in self.ranks:
                rank.settle(offers)
        assert self.ranks[0].pending == self.ranks[1].pending  # the same on every rank, always
        return sent

    def compiled(self, rank: int, text: str, error: bool = False) -> None:
        f = self.compiles[rank][text]
        f.set_exception(GrammarError("no")) if error else f.set_result(object())


def rids(sent: list) -> list:
    return [m.job.rid if isinstance(m, Insert) else type(m).__name__ for m in sent]


def test_an_insert_waits_until_every_rank_compiled_its_grammar_and_others_go_on():
    mesh = Mesh()
    assert rids(mesh.iteration([insert("held", "G"), insert("plain")])) == ["CompileGrammar", "plain"]
    assert mesh.iteration([]) == []
    mesh.compiled(1, "G")
    assert mesh.iteration([insert("later")]) == [insert("later")]  # rank 0 has not compiled it yet
    mesh.compiled(0, "G")
    assert mesh.iteration([]) == []  # agreed at this iteration ...
    assert rids(mesh.iteration([])) == ["held"]  # ... and the insert goes out at the next exchange
    assert mesh.ranks[0].pending == [] and not mesh.ranks[0].waiting


def test_answers_held_to_one_grammar_share_its_compile_and_a_cached_one_is_sent_again():
    mesh = Mesh()
    assert rids(mesh.iteration([insert("a", "G"), insert("b", "G")])) == ["CompileGrammar"]
    mesh.compiled(0, "G")
    mesh.compiled(1, "G")
    mesh.iteration([insert("c", "G")])
    assert rids(mesh.iteration([])) == ["a", "b", "c"]
    assert rids(mesh.iteration([insert("d", "G")])) == ["CompileGrammar"]  # ready at once: its future is done
    assert rids(mesh.iteration([])) == ["d"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_grammar_a_rank_could_not_compile_fails_its_requests_on_rank_0(rank):
    mesh = Mesh()
    mesh.iteration([insert("held", "G")])
    mesh.compiled(rank, "G", error=True)
    mesh.compiled(1 - rank, "G")
    mesh.iteration([])
    assert mesh.iteration([]) == [] and mesh.failed == ["held"]


def test_a_cancelled_request_leaves_the_wait_and_a_drain_lets_the_waiting_through_to_be_refused():
    mesh = Mesh()
    mesh.iteration([insert("gone", "G"), insert("stays", "H")])
    assert rids(mesh.iteration([Cancel("gone")])) == ["Cancel"]
    drain = Drain(DrainMode.FINISH)
    assert rids(mesh.iteration([drain])) == ["stays", "Drain"]
    mesh.compiled(0, "G")
    mesh.compiled(1, "G")
    assert mesh.iteration([]) == []  # the cancelled one never goes out
