"""The per-step output bytes of the requests being answered, over all of them: a request
takes its answer's size before its model runs and gives it back once its answer is built
(``request.answered``: the dispatcher calls it before sending), so that many requests, each within
``max_lm_output_bytes``, cannot together hold more memory than ``max_output_bytes_in_flight``
(issue 59, finding 3: 16 concurrent 61 MiB answers raised the server's memory by 3.9 GiB)."""

from __future__ import annotations

from .. import request
from ..errors import OutputsFull


class OutputsInFlight:
    """Event loop only (no lock). One request is always let in, whatever its size (it is
    within max_lm_output_bytes already): a budget below one request never stops the
    service."""

    def __init__(self, limit: int):
        self.limit = limit  # 0: no limit
        self.held = 0

    def take(self, size: int) -> None:
        """SIZE bytes for the current request until its answer is built; 503
        (Retry-After) when other requests hold the budget."""
        if not size or not self.limit:
            return
        if self.held and self.held + size > self.limit:
            raise OutputsFull(
                f"overloaded: answers of {self.held} bytes of per-step outputs are being "
                f"made or sent, and this one's {size} bytes would pass the limit of "
                f"{self.limit} (max_output_bytes_in_flight); retry later")
        self.held += size
        held = request.current()
        held.output_bytes += size
        held.give_back = self._give_back

    def _give_back(self, held: request.Scope) -> None:
        self.held -= held.output_bytes
        held.output_bytes = 0
