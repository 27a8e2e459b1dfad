"""The last record of each session a replica wrote or read, kept where a read of the store
is a round trip (``Sessions``): the next chunk of a session is computed from it without a
read, the store's compare-and-set refusing it if another replica wrote the session since."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .records import SessionRecord


class RecordCache:
    """Open records by session id, least recently used first, at most SIZE of them (the
    store's max_sessions: no more can be open; 0 keeps none). An ended record, or one
    without a stamp (written by a replica that sets none), is never kept."""

    def __init__(self, size: int):
        self.size = size
        self._records: OrderedDict[str, SessionRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def get(self, sid: str) -> SessionRecord | None:
        return self._records.get(sid)

    def put(self, record: SessionRecord) -> None:
        if record.ended or record.stamp is None or not self.size:
            self._records.pop(record.id, None)
            return
        self._records[record.id] = record
        self._records.move_to_end(record.id)
        if len(self._records) > self.size:
            self._records.popitem(last=False)

    def drop(self, sid: str) -> None:
        self._records.pop(sid, None)
