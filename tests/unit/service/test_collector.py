"""The server's collector tuning (service.server.launch.tune_collector), in a process of its
own: it freezes that process's heap for good."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json
from orthornn.service.server.launch import GEN0_THRESHOLD, tune_collector
before = {"tracked": len(gc.get_objects()), "threshold": gc.get_threshold()}
tune_collector()
after = {"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold(),
         "old": len(gc.get_objects(generation=2))}
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made after the start: still the collector's
del a, b
after["freed"] = gc.collect()
print(json.dumps({"before": before, "after": after, "gen0": GEN0_THRESHOLD}))
"""


def test_the_start_heap_is_frozen_and_new_cycles_are_still_collected():
    out = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True,
                                    text=True, check=True).stdout)
    before, after = out["before"], out["after"]
    # every object the start left (the imports) is out of the collector's sight...
    assert after["frozen"] >= 0.9 * before["tracked"]
    assert after["old"] < 0.01 * before["tracked"]
    # ...the young generation collected less often, the older ones as Python has them
    assert after["threshold"] == [out["gen0"], *before["threshold"][1:]]
    assert out["gen0"] > before["threshold"][0]
    # a garbage cycle made afterwards is freed (its two objects and their dicts)
    assert after["freed"] >= 2
