"""export/artifacts/records.py without a second process: the atomic write leaves the
old file or the new one, and a record's write under the lock sweeps the temporary files a
killed writer left for any record of the folder (the process-level kills are in
tests/integration/test_promotion_writers.py)."""

from __future__ import annotations

import json

import pytest
from orthornn.export.artifacts import records


def test_a_record_write_sweeps_every_records_leftover_but_not_other_files(tmp_path):
    (tmp_path / "rollout.json").write_text('{"old": true}\n')
    left = [tmp_path / ".rollout.json.0badc0de.tmp", tmp_path / ".promotion.json.12345678.tmp"]
    for path in left:
        path.write_text('{"half')  # what a writer killed mid-write leaves
    other = tmp_path / "..last_version.abcdef01.tmp"  # written without the lock: kept
    other.write_text("3")

    data = records.update_json(tmp_path, "promotion.json", lambda path: {"version": 2})

    assert data == {"version": 2}
    assert json.loads((tmp_path / "promotion.json").read_text()) == {"version": 2}
    assert json.loads((tmp_path / "rollout.json").read_text()) == {"old": True}
    assert not any(path.exists() for path in left)
    assert other.read_text() == "3"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "promotion.json"
    records.write_json(path, {"version": 1})

    def half_then_fail(tmp):
        tmp.write_text('{"vers')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        records.atomic_write(path, half_then_fail)
    assert json.loads(path.read_text()) == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["promotion.json"]
