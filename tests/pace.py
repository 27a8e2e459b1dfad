"""A rate for the client loops of the tests that serve while something else works (a
retraining, an export, a rollout): requests keep flowing through every swap and stage,
but at a fixed rate, not as fast as a Python client can send. An unpaced loop of two or
three clients held both cores of a 2-core CI machine for as long as the test ran, and
the work under test (the training and export processes) waited behind it: the loop's test
took 115 s alone and 243 s in CI (docs/design.md, "CI's time")."""

from __future__ import annotations

import time

#: requests a second of one client thread: far more than any stage or check counts (a
#: rollout stage's --min-requests, a swap seen within 5 answers), a tenth of a core or so
PER_CLIENT = 40.0


class Pace:
    """``wait()`` before each request: at most RATE a second from this thread, without
    catching up after a slow answer (a stall is not followed by a burst)."""

    def __init__(self, rate: float = PER_CLIENT):
        if not rate > 0:
            raise ValueError(f"rate must be > 0 requests a second, got {rate!r}")
        self.interval = 1.0 / rate
        self.next = time.monotonic()

    def wait(self) -> None:
        now = time.monotonic()
        if now < self.next:
            time.sleep(self.next - now)
            now = self.next
        self.next = now + self.interval
