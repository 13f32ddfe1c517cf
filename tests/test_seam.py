"""The store's fleet and weights records as the planes read them (meshd/seam.py): what the controller writes
reads back the same, and a value that is not such a record reads as none."""

import pytest

from common.states import Phase
from meshd.seam import FleetRecord, WeightsRecord
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
