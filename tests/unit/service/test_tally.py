"""The plain-integer counter capture counts its records and drops with: exact under
threads, and exposed as prometheus_client's own Counter exposes the same counts."""

import threading

from orthornn.service.metrics import Tally
from prometheus_client import CollectorRegistry, Counter, generate_latest


def test_counts_from_many_threads_add_up_exactly():
    registry = CollectorRegistry()
    tally = Tally("orthornn_test_drops", "drops", "reason", registry)

    def bump(reason: str) -> None:
        for _ in range(20_000):
            tally.inc(reason)
    threads = [threading.Thread(target=bump, args=(r,)) for r in ("a", "a", "b", "a")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tally.inc("b", 5)
    counted = {r: registry.get_sample_value("orthornn_test_drops_total", {"reason": r})
               for r in ("a", "b", "c")}
    assert counted == {"a": 60_000, "b": 20_005, "c": None}  # "c": never counted, no series


def test_it_is_exposed_as_a_counter_of_the_same_counts():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    tally = Tally("orthornn_test_records", "records written", "model", ours)
    counter = Counter("orthornn_test_records", "records written", ["model"], registry=theirs)
    for model, n in (("digits", 3), ("adding", 1), ("digits", 2)):
        tally.inc(model, n)
        counter.labels(model).inc(n)
    expected = [line for line in generate_latest(theirs).decode().splitlines()
                if "_created" not in line]  # the time a series began: not kept here
    assert sorted(generate_latest(ours).decode().splitlines()) == sorted(expected)
