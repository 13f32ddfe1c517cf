"""The store's fleet record as the planes read it (meshd/seam.py): what the controller writes reads back
the same, and a value that is not such a record reads as none."""

import pytest

from common.states import Phase
from meshd.seam import FleetRecord
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
