"""The store's fleet and weights records as the planes read them (meshd/seam.py): what the controller writes
reads back the same, and a value that is not such a record reads as none."""

import asyncio
import random
import threading

import pytest

from common.states import Phase
from meshd.seam import FleetRecord, WeightsRecord, wait_until
from meshd.store import Store


@pytest.mark.parametrize("stored, record", [
    ({"phase": "ready", "generation": 4}, FleetRecord(Phase.READY, 4)),
    ({"phase": "stopped", "generation": "7"}, FleetRecord(Phase.STOPPED, 7)),
    (None, None),
    ({"phase": "asleep", "generation": 4}, None),
    ({"generation": 4}, None),
    ({"phase": "ready", "generation": None}, None),
    (["ready", 4], None),
])
def test_a_stored_value_reads_as_the_record_it_holds_or_none(stored, record):
    assert FleetRecord.from_wire(stored) == record


def test_what_the_controller_writes_another_process_reads_back(tmp_path):
    store = Store(tmp_path / "meshd.sqlite")
    assert FleetRecord.read(tmp_path / "meshd.sqlite") is None
    store.put(FleetRecord.KEY, FleetRecord(Phase.RECOVERING, 3).wire())
    assert FleetRecord.read(tmp_path / "meshd.sqlite") == FleetRecord(Phase.RECOVERING, 3)
    assert FleetRecord.read(tmp_path / "none.sqlite") is None


@pytest.mark.parametrize("stored, record", [
    ({"generation": 4, "fingerprint": "ab12"}, WeightsRecord(4, "ab12")),
    ({"generation": -1, "fingerprint": ""}, WeightsRecord(-1, "")),  # the controller's before any generation
    (None, None),
    ({"fingerprint": "ab12"}, None),
    ({"generation": "four", "fingerprint": "ab12"}, None),
])
def test_a_stored_weights_value_reads_as_the_record_it_holds_or_none(stored, record):
    assert WeightsRecord.from_wire(stored) == record


def test_the_weights_the_controller_records_the_proxy_reads_back(tmp_path):
    store = Store(tmp_path / "meshd.sqlite")
    assert WeightsRecord.read(tmp_path / "meshd.sqlite") is None
    store.put(WeightsRecord.KEY, WeightsRecord(3, "ab12").wire())
    assert WeightsRecord.read(tmp_path / "meshd.sqlite") == WeightsRecord(3, "ab12")


def test_waits_raced_and_cancelled_as_the_proxy_races_them_never_leave_the_fleet_locked():
    """The proxy races a cut stream's waits over its meshes and cancels the ones that lost (proxy.py); each is a
    wait_until on a fleet's condition. Built on asyncio.wait_for, under Python 3.11 such a cancel could leave
    the condition locked for good ("Lock is not acquired" at the waiter's exit): the proxy's follow loop then
    never took the controller's next generation, a cut stream never resumed, and the proxy's drain never
    ended. Every run of this test failed that way then; each change must now get through at once."""
    async def scenario(seed: int) -> tuple[int, bool]:
        rng = random.Random(seed)
        changed, state = asyncio.Condition(), {"changes": 0}

        async def race() -> None:
            while True:
                seen = state["changes"]
                waits = [asyncio.ensure_future(wait_until(changed, lambda: state["changes"],
                                                          lambda now, k=rng.randint(0, 3): now > seen + k,
                                                          rng.random() * 0.01)) for _ in range(2)]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()

        racers = [asyncio.create_task(race()) for _ in range(20)]
        try:
            for _ in range(1500):
                try:
                    async with asyncio.timeout(5):
                        async with changed:
                            state["changes"] += 1
                            changed.notify_all()
                except TimeoutError:
                    break
                await asyncio.sleep(rng.random() * 0.002)
        finally:
            for r in racers:
                r.cancel()
            await asyncio.gather(*racers, return_exceptions=True)
        return state["changes"], changed.locked()

    for seed in range(3):  # in a thread of its own: a racer that swallowed its cancel would hang the test's own loop
        ran: dict = {}
        thread = threading.Thread(target=lambda: ran.update(result=asyncio.run(scenario(seed))), daemon=True)
        thread.start()
        thread.join(120)
        assert not thread.is_alive(), "the racers never ended after their cancel: they wait on a condition left locked"
        assert ran["result"] == (1500, False)
