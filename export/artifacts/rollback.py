"""Rolling a model's promotion back (``orthornn rollback``, the admin API's rollback):
which version to go back to, checked to verify, and the promotion moved to it, decided
from the record as it is (under the model's lock; in a bucket, written only if the
record is unchanged since it was read)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from . import records, remote
from .numbers import is_integer
from .repository import (
    PROMOTION,
    last_name,
    live_version,
    local_model,
    promote,
    promotion_of,
    read_promotion,
    versions,
    with_entry,
)
from .storage import is_object_uri, open_store
from .storage.store import join


def rollback(model_dir: str | Path, to: int | None = None) -> dict:
    """Move the promotion of model_dir back: to ``to``, or one step (the version promoted
    before the current one, else the newest below it). The target must be on disk and
    verify (sha256 and golden outputs); ValueError names the versions that could be used.
    Decided and written under the model's lock (``records.locked``), so that the step back
    is from the promotion as it is, never from one another writer has just replaced. An
    unreadable promotion.json takes an explicit ``to`` (it is replaced, a copy kept).
    Returns {"model", "promoted", "previous"} (previous None: the file was unreadable).
    In a bucket: decided from the record as read, and written only if it is unchanged
    since (else decided again), over a mirror of the versions."""
    if is_object_uri(str(model_dir)):
        return _rollback_object(str(model_dir), to)
    model_dir = Path(model_dir)
    with records.locked(model_dir):
        on_disk = versions(model_dir)
        if not on_disk:
            raise ValueError(f"{str(model_dir)!r} holds no versions")
        try:
            record: dict | None = read_promotion(model_dir)
        except ValueError as error:
            if to is None:
                raise ValueError(f"{error}; name the version to promote (--to V) to replace "
                                 f"it") from None
            record = None
        current = None if record is None else live_version(on_disk, record["version"])
        target = _rollback_target(model_dir, on_disk, record, current, to)
        promote(model_dir, target, "rollback", f"rolled back from version {current}"
                if current is not None else "rolled back (promotion.json was unreadable)")
    return {"model": model_dir.name, "promoted": target, "previous": current}


def _rollback_object(location: str, to: int | None) -> dict:
    store = open_store(location)
    decided: dict = {"model": last_name(location)}
    with local_model(location) as local:
        on_disk = versions(local)
        if not on_disk:
            raise ValueError(f"{location!r} holds no versions")

        def change(data: bytes | None) -> dict:
            now = dt.datetime.now(dt.UTC)
            try:
                record: dict | None = promotion_of(
                    None if data is None else json.loads(data), join(location, PROMOTION))
            except ValueError as error:
                if to is None:
                    raise ValueError(f"{error}; name the version to promote (--to V) to "
                                     f"replace it") from None
                store.write(f"{PROMOTION}.unreadable-{now.strftime('%Y%m%dT%H%M%S.%fZ')}",
                            data or b"")
                record = None
            current = None if record is None else live_version(on_disk, record["version"])
            target = _rollback_target(local, on_disk, record, current, to)
            decided.update(promoted=target, previous=current)
            note = (f"rolled back from version {current}" if current is not None
                    else "rolled back (promotion.json was unreadable)")
            return with_entry(record or {"version": None, "history": []}, target,
                               "rollback", note, now)
        remote.update(store, PROMOTION, change)
    return decided


def _rollback_target(model_dir: Path, on_disk: list[int], record: dict | None,
                     current: int | None, to: int | None) -> int:
    from .package import PackageError, verify_package

    def usable() -> str:
        good = []
        for v in on_disk:
            if v == current:
                continue
            try:
                verify_package(model_dir / str(v))
            except PackageError:
                continue
            good.append(str(v))
        return ", ".join(good) or "none"

    if to is None:
        assert record is not None and current is not None  # on_disk is not empty
        # what was live before current went live (not before a rollback to it: rolling
        # back twice goes two steps back, never forth again)
        earlier = [e.get("previous") for e in reversed(record["history"])
                   if e.get("version") == current and e.get("action") != "rollback"]
        target = next((v for v in earlier if v in on_disk and v != current), None)
        if target is None:
            target = max((v for v in on_disk if v < current), default=None)
        if target is None:
            raise ValueError(f"nothing to roll back to: version {current} is the oldest; "
                             f"versions it could use: {usable()}")
    else:
        target = to
    if not is_integer(target) or target not in on_disk:
        raise ValueError(f"version {target!r} is not in {str(model_dir)!r}; versions it could "
                         f"use: {usable()}")
    if target == current:
        raise ValueError(f"version {target} is already promoted; versions it could use: "
                         f"{usable()}")
    try:
        verify_package(model_dir / str(target))
    except PackageError as error:
        raise ValueError(f"version {target} does not verify ({error}); versions it could "
                         f"use: {usable()}") from None
    return target
