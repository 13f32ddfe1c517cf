"""The scheduler's decisions (runtime/engine/scheduler.py), as tables; a batch's steps as its plans make them, and the
drafted engine's routing between a request alone and the batch, with fake executors: arrivals, prompts going in,
joins, hand-overs and cancels in milliseconds, no model and no mesh."""

from dataclasses import replace

import pytest

from runtime.engine.drafting import DraftWhenAlone
from runtime.engine.jobs import Emission, Job
from runtime.engine.scheduler import Admission, Plan, Row, admit, adopt_restored, plan

GREEDY = {"temperature": 0.0}


@pytest.mark.parametrize("waiting,alone,batched,expected", [
    (0, False, False, Admission()),  # nothing waits: nothing changes
    (0, True, False, Admission()),  # the one alone goes on alone
    (1, False, False, Admission(alone=True)),  # a lone request runs alone
    (2, False, False, Admission(join=2)),  # two at once: both batched, neither alone
    (1, True, False, Admission(hand_over=True, join=1)),  # a second request: the one alone hands over
    (3, True, False, Admission(hand_over=True, join=3)),
    (1, False, True, Admission(join=1)),  # the batch runs: a newcomer joins it
])
def test_a_request_runs_alone_only_while_nothing_else_does(waiting, alone, batched, expected):
    assert admit(waiting, alone, batched) == expected


@pytest.mark.parametrize("warm,draining,busy,awaited,adopts", [
    (False, False, False, False, False),  # the warm-up first: ready comes before old tapes
    (True, False, False, False, True),  # idle: restored tapes join now
    (True, False, True, False, False),  # decoding: building their caches would stall the step
    (True, False, True, True, True),  # unless a request waits for one of them
    (True, True, False, True, False),  # never while draining
])
def test_restored_tapes_join_when_ready_and_idle_or_awaited(warm, draining, busy, awaited, adopts):
    assert adopt_restored(warm, draining, busy, awaited) is adopts


@pytest.mark.parametrize("joining,rows,expected", [
    ((), (), Plan()),  # nothing: no step
    ((), (Row("a", width=5), Row("b", width=2)), Plan(width=5, verify=True)),  # as wide as the widest drafted
    ((), (Row("a"), Row("b")), Plan(verify=True)),  # no row drafted: one place a row
    ((Row("c", left=9, piece=4),), (), Plan(prefill="c")),  # a piece of the prompt; the rest next step
    ((Row("c", left=5, piece=4, width=3),), (), Plan("c", "c", 3, True)),  # its last piece: joins, verifies
    ((Row("c", width=3),), (Row("a", width=1),), Plan(None, "c", 3, True)),  # only its last token was left
    ((Row("c", left=9, piece=4), Row("d")), (Row("a"),), Plan("c", None, 0, True)),  # d waits behind c
    ((Row("c", left=9, piece=4, width=5),), (Row("a", width=2),), Plan("c", None, 2, True)),  # c not in it yet
])
def test_a_batch_step_prefills_the_first_prompt_joins_it_at_its_last_token_and_verifies_at_the_widest_draft(
        joining, rows, expected):
    assert plan(joining, rows) == expected


class FakeRows:
    """A batch's executor as RowwiseDSpark is one: prompts go in `chunk` tokens a step (all but their last), each
    row says a token a step; it records what each step did."""

    def __init__(self, chunk=4):
        self.chunk, self.joining, self.rows, self.done = chunk, [], {}, []

    def insert(self, rid, prompt, answer, width=0):
        self.joining.append([rid, prompt, answer, width])

    def cancel(self, rid):
        self.joining = [j for j in self.joining if j[0] != rid]
        self.rows.pop(rid, None)

    def seen(self):
        return ([Row(rid, left, min(self.chunk, left - 1), width) for rid, left, _, width in self.joining],
                [Row(rid, width=width) for rid, (_, width) in self.rows.items()])

    def step(self):
        step = plan(*self.seen())
        did = []
        if step.prefill:
            first = self.joining[0]
            first[1] -= min(self.chunk, first[1] - 1)
            did.append(f"prefill {step.prefill} to {first[1]}")
        if step.join:
            rid, _, answer, width = self.joining.pop(0)
            self.rows[rid] = [answer, width]
            did.append(f"join {rid}")
        if step.verify:
            did.append(f"verify {''.join(self.rows)} at {step.width}")
            for rid, row in list(self.rows.items()):
                row[0] -= 1
                if not row[0]:
                    del self.rows[rid]
                    self.done.append(rid)
        return did


def test_prompts_go_in_first_come_first_join_at_their_last_piece_and_a_cancel_frees_the_next():
    batch = FakeRows(chunk=4)
    batch.insert("a", prompt=6, answer=3, width=5)
    batch.insert("b", prompt=3, answer=3)
    batch.insert("c", prompt=9, answer=2, width=2)
    steps = [batch.step()]
    batch.cancel("c")  # still behind b: never goes in
    steps += [batch.step() for _ in range(4)]
    assert steps == [
        ["prefill a to 2"],  # a's first piece; b and c wait behind it
        ["prefill a to 1", "join a", "verify a at 5"],  # a's last piece: it joins and verifies in the same step
        ["prefill b to 1", "join b", "verify ab at 5"],  # b is plain: it fills a's width with guesses
        ["verify ab at 5"],  # a ends
        ["verify b at 0"],  # b alone, plain: one place
    ]
    assert batch.done == ["a", "b"] and not batch.joining and not batch.rows


def test_a_row_whose_drafting_ends_narrows_the_verify_and_a_cancelled_row_leaves_it():
    batch = FakeRows()
    batch.insert("a", prompt=1, answer=9, width=3)
    batch.insert("b", prompt=1, answer=9, width=5)
    assert batch.step() == ["join a", "verify a at 3"]
    assert batch.step() == ["join b", "verify ab at 5"]
    batch.rows["b"][1] = 0  # b's drafts refused: plain from here
    assert batch.step() == ["verify ab at 3"]
    batch.cancel("a")
    assert batch.step() == ["verify b at 0"]


class FakeDrafter:
    """One request at a time, a token a step: the token is its count so far."""

    def __init__(self):
        self.job, self.said, self.queue = None, 0, []

    @property
    def busy(self):
        return self.job is not None or bool(self.queue)

    def insert(self, job):
        self.queue.append(job)

    def step(self):
        if self.job is None:
            self.job, self.said = self.queue.pop(0), 0
        self.said += 1
        done = self.said == self.job.max_tokens
        e = Emission(self.job.rid, self.said, "length" if done else None, cached=0 if self.said == 1 else None)
        if done:
            self.job = None
        return [e]

    def handover(self):
        job, said = self.job, self.said
        self.job = None
        rest = replace(job, prompt=job.prompt + tuple(range(1, said + 1)), max_tokens=job.max_tokens - said,
                       offset=job.offset + said)
        return rest, None if said else 0

    def cancel(self, rid):
        if self.job is not None and self.job.rid == rid:
            self.job = None
        self.queue = [j for j in self.queue if j.rid != rid]

    def stats(self):
        return {"draft_proposed": 0, "draft_accepted": 0, "draft_fallbacks": 0}


class FakeBatch:
    """Every row a token a step, the token its place in the answer; `cached` what its insert said."""

    def __init__(self):
        self.rows = {}

    @property
    def busy(self):
        return bool(self.rows)

    def insert(self, job):
        self.rows[job.rid] = [job, job.offset]
        return len(job.prompt) - 1

    def step(self):
        out = []
        for rid, row in list(self.rows.items()):
            row[1] += 1
            done = row[1] == row[0].offset + row[0].max_tokens
            out.append(Emission(rid, row[1], "length" if done else None))
            if done:
                del self.rows[rid]
        return out

    def cancel(self, rid):
        self.rows.pop(rid, None)

    def stats(self):
        return {}


def job(rid, n=4):
    return Job(rid, (7, 8, 9), n, 0, GREEDY)


def run(engine, arrivals: dict[int, list[Job]]):
    """Each step's arrivals inserted before it, as the lockstep loop does; the emissions by step."""
    steps, at = [], 0
    while engine.busy or any(s >= at for s in arrivals):
        for j in arrivals.get(at, []):
            engine.insert(j)
        steps.append([(e.rid, e.token, e.cached) for e in engine.step()])
        at += 1
    return steps


def test_a_lone_request_is_drafted_and_a_second_hands_it_over_to_the_batch_keeping_its_place():
    drafter, batch = FakeDrafter(), FakeBatch()
    engine = DraftWhenAlone(drafter, batch, log=lambda line: None)
    steps = run(engine, {0: [job("a", 5)], 2: [job("b", 2)]})
    assert steps == [[("a", 1, 0)], [("a", 2, None)],  # alone, drafted
                     [("a", 3, None), ("b", 1, 2)],  # b came: a went on in the batch from its third token
                     [("a", 4, None), ("b", 2, None)], [("a", 5, None)]]
    assert engine.handovers == 1


def test_requests_that_come_together_are_batched_and_a_newcomer_joins_the_running_batch():
    engine = DraftWhenAlone(FakeDrafter(), FakeBatch(), log=lambda line: None)
    steps = run(engine, {0: [job("a", 3), job("b", 3)], 1: [job("c", 1)]})
    assert steps[0] == [("a", 1, 2), ("b", 1, 2)]  # neither alone: no drafted answer to hand over
    assert ("c", 1, None) in steps[1]  # joined at its insert, which said how much of it was cached
    assert engine.handovers == 0


def test_a_cancelled_request_is_dropped_wherever_it_is_and_the_rest_go_on():
    drafter, batch = FakeDrafter(), FakeBatch()
    engine = DraftWhenAlone(drafter, batch, log=lambda line: None)
    engine.insert(job("a", 5))
    engine.insert(job("b", 5))  # both wait for the next step
    engine.cancel("b")
    assert [e.rid for e in engine.step()] == ["a"]  # a alone again: drafted
    assert drafter.job.rid == "a" and not batch.busy
    engine.insert(job("c", 2))
    engine.step()  # a hands over, c joins
    engine.cancel("a")
    assert [e.rid for e in engine.step()] == ["c"]
    assert not engine.busy
