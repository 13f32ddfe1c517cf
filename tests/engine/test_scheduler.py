"""The scheduler's decisions (runtime/engine/scheduler.py), as tables, and a batch's steps as its plans make them,
with a fake executor: arrivals, prompts going in, joins, a row's drafting ending and cancels in milliseconds, no
model and no mesh."""

import pytest

from runtime.engine.scheduler import Plan, Row, adopt_restored, ahead, doze_before, plan


@pytest.mark.parametrize("warm,draining,busy,awaited,adopts", [
    (False, False, False, False, False),  # the warm-up first: ready comes before old tapes
    (True, False, False, False, True),  # idle: restored tapes join now
    (True, False, True, False, False),  # decoding: building their caches would stall the step
    (True, False, True, True, True),  # unless a request waits for one of them
    (True, True, False, True, False),  # never while draining
])
def test_restored_tapes_join_when_ready_and_idle_or_awaited(warm, draining, busy, awaited, adopts):
    assert adopt_restored(warm, draining, busy, awaited) is adopts


@pytest.mark.parametrize("idle_for,behind,awaited,doze", [
    (0.0, False, False, 0.01),  # right after activity: a burst of requests stays snappy
    (1.0, False, False, 0.25),  # a fourth of the idle time
    (60.0, False, False, 0.5),  # idle for long: the idle interval
    (60.0, True, False, 0.05),  # restores or compiles behind serving: every exchange moves them on
    (0.0, True, True, 0.0),  # a request waits for a restore: no doze between its tape's parts
    (60.0, True, True, 0.0),
])
def test_idle_ranks_doze_less_while_work_goes_on_behind_and_not_while_a_request_waits_for_a_restore(
        idle_for, behind, awaited, doze):
    assert doze_before(idle_for, 0.5, behind, awaited) == doze


@pytest.mark.parametrize("joining,plain,goes_ahead", [
    (0, [], False),  # no rows: nothing to queue
    (0, [True], True),  # a lone plain row: the next step queued before this one is read back
    (0, [True, True, True], True),
    (0, [True, False], False),  # a row drafts: its next step needs this one read back
    (1, [True, True], False),  # a prompt waits to join: the batch changes at the next step
])
def test_a_step_is_queued_ahead_only_while_every_row_is_plain_and_none_joins(joining, plain, goes_ahead):
    assert ahead(joining, plain) is goes_ahead


@pytest.mark.parametrize("joining,rows,expected", [
    ((), (), Plan()),  # nothing: no step
    ((), (Row("a", width=5), Row("b", width=2)), Plan(width=5, verify=True)),  # as wide as the most drafts
    ((), (Row("a"), Row("b")), Plan(verify=True)),  # no row has drafts: one place a row
    ((Row("c", left=9, piece=4),), (), Plan(prefill=("c",))),  # a piece of the prompt; the rest next step
    ((Row("c", left=5, piece=4),), (), Plan(("c",), ("c",), 0, True)),  # its last piece: joins, verifies
    ((Row("c"),), (Row("a", width=1),), Plan((), ("c",), 1, True)),  # only its last token was left
    ((Row("c", left=9, piece=4), Row("d")), (Row("a"),), Plan(("c",), (), 0, True)),  # d waits behind c
    ((Row("c", left=9, piece=4, width=5),), (Row("a", width=2),), Plan(("c",), (), 2, True)),  # c not in it yet
    # prompts at one place with pieces as long go in together, in one forward of one shape
    ((Row("c", left=9, piece=4), Row("d", left=7, piece=4)), (), Plan(prefill=("c", "d"))),
    ((Row("c", left=9, piece=4), Row("d", left=9, piece=4, at=3)), (), Plan(prefill=("c",))),  # d further in
    ((Row("c", left=9, piece=4), Row("d", left=3, piece=2)), (), Plan(prefill=("c",))),  # d's piece is shorter
    ((Row("c", left=9, piece=4), Row("d", left=3, piece=2), Row("e", left=5, piece=4)), (),
     Plan(prefill=("c", "e"))),  # e goes in with c, ahead of d
    ((Row("c", left=5, piece=4), Row("d", left=5, piece=4)), (Row("a"),), Plan(("c", "d"), ("c", "d"), 0, True)),
    ((Row("c", left=5, piece=4), Row("d")), (), Plan(("c",), ("c", "d"), 0, True)),  # d in already: both join
    ((Row("c", left=9, piece=4), Row("d", left=5, piece=4)), (), Plan(prefill=("c", "d"))),  # d waits behind c
])
def test_a_batch_step_prefills_the_first_prompt_and_its_like_joins_each_at_its_last_token_verifies_at_the_most_drafts(
        joining, rows, expected):
    assert plan(joining, rows, 16) == expected


@pytest.mark.parametrize("joining,room,expected", [
    ((Row("c", left=9, piece=4),), 2, Plan(("c",), (), 0, True)),  # its prompt goes in, in its own caches
    ((Row("c"),), 2, Plan((), (), 0, True)),  # in, it waits for a row to end
    ((Row("c", left=5, piece=4),), 2, Plan(("c",), (), 0, True)),  # its last piece goes in; it waits, its last
    # token left
    ((Row("c"), Row("d")), 3, Plan((), ("c",), 0, True)),  # room for one: the first that came
])
def test_a_full_batch_takes_no_row_until_one_ends(joining, room, expected):
    assert plan(joining, (Row("a"), Row("b")), room) == expected


@pytest.mark.parametrize("room,expected", [
    (1, Plan(prefill=("c",))),  # one request at a time (--completion-batch-size 1): no caches merged
    (2, Plan(prefill=("c", "d"))),
])
def test_prompts_go_in_together_only_where_the_batch_takes_more_than_one_row(room, expected):
    assert plan((Row("c", left=9, piece=4), Row("d", left=9, piece=4)), (), room) == expected


class FakeRows:
    """A batch's executor as the drafting engine is one: prompts go in `chunk` tokens a step (all but their last), each
    row says a token a step and has its drafts from its second step on; it records what each step did."""

    def __init__(self, chunk=4):
        self.chunk, self.joining, self.rows, self.done = chunk, [], {}, []

    def insert(self, rid, prompt, answer, width=0):
        self.joining.append([rid, prompt, answer, width, prompt])

    def refuse(self, rid):
        """The row's drafting ends: plain from here."""
        self.rows[rid][1] = 0

    def cancel(self, rid):
        self.joining = [j for j in self.joining if j[0] != rid]
        self.rows.pop(rid, None)

    def seen(self):
        return ([Row(rid, left, min(self.chunk, left - 1), at=prompt - left)
                 for rid, left, _, _, prompt in self.joining],
                [Row(rid, width=width if drafted else 0) for rid, (_, width, drafted) in self.rows.items()])

    def step(self):
        step = plan(*self.seen(), 16)
        did = []
        going = [j for j in self.joining if j[0] in step.prefill]
        for j in going:
            j[1] -= min(self.chunk, j[1] - 1)
        if going:
            did.append("prefill " + ", ".join(f"{j[0]} to {j[1]}" for j in going))
        for _ in step.join:
            rid, _, answer, width, _ = self.joining.pop(0)
            self.rows[rid] = [answer, width, False]
            did.append(f"join {rid}")
        if step.verify:
            did.append(f"verify {''.join(self.rows)} at {step.width}")
            for rid, row in list(self.rows.items()):
                row[0], row[2] = row[0] - 1, True
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
    batch.cancel("c")  # part of its prompt in: it goes no further
    steps += [batch.step() for _ in range(4)]
    assert steps == [
        ["prefill a to 2, c to 5"],  # a's first piece and c's, as long: one forward; b waits behind them
        ["prefill a to 1", "join a", "verify a at 0"],  # a's last piece: it joins and verifies, no drafts yet
        ["prefill b to 1", "join b", "verify ab at 5"],  # a drafted; b is plain: it fills a's width with guesses
        ["verify ab at 5"],  # a ends
        ["verify b at 0"],  # b alone, plain: one place
    ]
    assert batch.done == ["a", "b"] and not batch.joining and not batch.rows


def test_a_row_whose_drafting_ends_narrows_the_verify_and_a_cancelled_row_leaves_it():
    batch = FakeRows()
    batch.insert("a", prompt=1, answer=9, width=3)
    batch.insert("b", prompt=1, answer=9, width=5)
    assert batch.step() == ["join a", "join b", "verify ab at 0"]  # both in: they join together, no drafts yet
    assert batch.step() == ["verify ab at 5"]
    batch.refuse("b")
    assert batch.step() == ["verify ab at 3"]
    batch.cancel("a")
    assert batch.step() == ["verify b at 0"]
