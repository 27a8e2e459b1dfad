"""A writer of a model's promotion.json and rollout.json, run as a process of its own by
tests/integration/test_promotion_writers.py: ``python -m tests.promotion_writer ROLE MODEL_DIR
ROUNDS SEED TAG`` (MODEL_DIR a folder, or a model's s3:// URI). Each action it completed
is one JSON line on stdout (the test checks the history against them).

Roles: ``promote`` (what ``orthornn export`` does last: repository.promote), ``rollback``
(``orthornn rollback --to V`` and the admin API: repository.rollback), ``rollout`` (start
a rollout and let the controller finish it: rollout.start, then rollout.step), and
``loop`` (promote and write the plan for ever, to be SIGKILLed at random points).

A writer other than ``loop`` says it is ready and waits for a line on stdin (the test's
start barrier: every writer has imported and is about to write when the first begins).
ORTHORNN_TEST_NO_LOCK=1 replaces the model's lock by a no-op, and a bucket's conditional
writes by plain ones: the planted bug the concurrent-writers test must catch.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import random
import sys
import time
from pathlib import Path

from orthornn.export.artifacts import records, remote, repository, rollback, rollout
from orthornn.export.artifacts.storage import S3, is_object_uri, open_store


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def write_plan(model_dir: Path | str, plan: dict) -> None:
    """rollout.json replaced by PLAN, as a writer of it does in a folder or a bucket."""
    if isinstance(model_dir, Path):
        records.update_json(model_dir, rollout.ROLLOUT, lambda path: plan)
    else:
        remote.update(open_store(model_dir), rollout.ROLLOUT, lambda data: plan)


def main(role: str, model_dir: Path | str, rounds: int, seed: int, tag: str) -> None:
    rng = random.Random(seed)
    on_disk = repository.versions(model_dir)
    if os.environ.get("ORTHORNN_TEST_NO_LOCK") == "1":  # the planted bug
        records.locked = lambda model_dir: contextlib.nullcontext()  # type: ignore[assignment]
        S3.write_if_absent = S3.write_if_unchanged = (  # type: ignore[method-assign]
            lambda self, key, data, etag=None: S3.write(self, key, data))
    say(ready=True)
    if role != "loop":
        sys.stdin.readline()  # the start barrier
    if role == "loop":
        i = 0
        while True:  # killed by the test
            i += 1
            repository.promote(model_dir, on_disk[i % len(on_disk)], "publish", f"{tag}:{i}")
            write_plan(model_dir, {"id": f"{tag}-{i}", "state": "aborted", "round": i,
                                   "padding": "x" * 4096})
    for i in range(rounds):
        # a pause outside the lock between rounds: a writer that was let go first cannot
        # finish all its rounds before the others are scheduled on a loaded machine, so
        # the writers contend for the lock throughout (the test checks they interleaved)
        time.sleep(rng.uniform(0.002, 0.006))
        if role == "promote":
            version = rng.choice(on_disk)
            record = repository.promote(model_dir, version, "promote", f"{tag}:{i}")
            say(action="promote", tag=f"{tag}:{i}", version=version,
                previous=record["history"][-1]["previous"])
        elif role == "rollback":
            try:
                done = rollback.rollback(model_dir, rng.choice(on_disk))
            except ValueError as error:  # the version drawn is the promoted one
                assert "already promoted" in str(error), error
                continue
            say(action="rollback", version=done["promoted"], previous=done["previous"])
        elif role == "rollout":
            try:
                plan = rollout.start(model_dir, rng.choice(on_disk), shadow=0, steps="100",
                                     interval_s=0.001, min_requests=1)
            except rollout.RolloutError as error:  # drawn the promoted version
                assert "already promoted" in str(error), error
                continue
            tally = rollout.Tally(candidate=rollout.Side(1, 0), promoted=rollout.Side(1, 0))
            report = {"rollout": plan.id, "stages": {"0": tally.to_dict()}}
            later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
            done = rollout.step(model_dir, [report], later)
            assert done is not None and done.state in ("promoted", "aborted"), done
            say(action="rollout", id=plan.id, state=done.state, version=plan.candidate,
                previous=plan.promoted, reason=done.reason)
        else:
            raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    location = sys.argv[2] if is_object_uri(sys.argv[2]) else Path(sys.argv[2])
    main(sys.argv[1], location, int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
