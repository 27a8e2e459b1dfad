"""A model of a repository in a store (``storage``), where there is no rename and no lock:
the store is rooted at the model (``s3://bucket/prefix/NAME``), its keys are
``<version>/<file>``, ``promotion.json``, ``rollout.json``, ``rejected/<id>/<file>``.

- A version is claimed by creating ``<version>/.claim`` if absent (two publishers never
  take one number), its files are uploaded, and its ``manifest.json`` last: a version
  exists for a reader once its manifest does, and then all its files do. A claim whose
  upload died is a hole in the numbering, never a version.
- A record is replaced by read -> change -> write-if-unchanged (the ETag read), from the
  top again when another writer got there first: no change is lost, as under the flock.
- ``mirror`` copies versions and records into a local folder laid out as a repository,
  each version by one rename, for everything that reads a package from a disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from . import records
from .storage import Changed, Exists, Store

MANIFEST = "manifest.json"
CLAIM = ".claim"
LAST = ".last_version"
RECORDS = ("promotion.json", "rollout.json")
TRIES = 200  # a record's update retried this many times before giving up


def numbered(keys: Iterable[str]) -> dict[int, set[str]]:
    """Each version number with any key under it -> the file names under it (a name that
    is no file name, "." or "..", is not one: it never becomes a path in a mirror)."""
    found: dict[int, set[str]] = {}
    for key in keys:
        head, _, rest = key.partition("/")
        if head.isdigit() and rest not in ("", ".", "..") and "/" not in rest:
            found.setdefault(int(head), set()).add(rest)
    return found


def versions(store: Store) -> list[int]:
    """The complete versions (those with a manifest), sorted."""
    return sorted(v for v, files in numbered(store.list()).items() if MANIFEST in files)


def _next(store: Store) -> int:
    last = 0
    with contextlib.suppress(FileNotFoundError, ValueError):
        last = int(store.read(LAST).data.decode().strip())
    return max([last, *numbered(store.list())]) + 1


def upload(store: Store, prefix: str, folder: Path, last: str | None = None) -> None:
    """Every file of FOLDER under PREFIX/, LAST (a file name) after all the others."""
    for name in sorted((p.name for p in folder.iterdir() if p.is_file()),
                       key=lambda n: (n == last, n)):
        data = (folder / name).read_bytes()
        if name == last:
            store.write_if_absent(f"{prefix}/{name}", data)
        else:
            store.write(f"{prefix}/{name}", data)


def publish(store: Store, build: Callable[[Path, int], None]) -> int:
    """Claim the next version number, BUILD(tmp, version) it locally, upload it manifest
    last; returns the version."""
    for _ in range(TRIES):
        version = _next(store)
        try:
            store.write_if_absent(f"{version}/{CLAIM}", json.dumps(
                {"pid": os.getpid(), "host": os.uname().nodename,
                 "time": time.time()}).encode())
        except Exists:  # another publisher took it: the next one
            continue
        with tempfile.TemporaryDirectory(prefix="orthornn-publish-") as tmp:
            build(Path(tmp), version)
            upload(store, str(version), Path(tmp), last=MANIFEST)
        store.write(LAST, f"{version}\n".encode())  # a hint: numbers only grow
        return version
    raise OSError(f"could not claim a version number in {store.uri}")


def read_record(store: Store, key: str) -> Any:
    """The record's JSON, or None when there is none; ValueError naming the object when it
    is not JSON."""
    try:
        blob = store.read(key)
    except FileNotFoundError:
        return None
    try:
        return json.loads(blob.data)
    except ValueError as error:
        raise ValueError(f"{store.uri}/{key} cannot be read: {error}") from None


def update(store: Store, key: str, change: Callable[[bytes | None], Any]) -> Any:
    """KEY's record replaced by CHANGE(its bytes, or None when absent), written only if
    no other writer replaced it since the read (else read and changed again); returns the
    record written. CHANGE may raise, or return None, to write nothing (then None)."""
    for attempt in range(TRIES):
        try:
            blob = store.read(key)
            current, etag = blob.data, blob.etag
        except FileNotFoundError:
            current, etag = None, None
        record = change(current)
        if record is None:
            return None
        data = (json.dumps(record, indent=2) + "\n").encode()
        try:
            if etag is None:
                store.write_if_absent(key, data)
            else:
                store.write_if_unchanged(key, data, etag)
            return record
        except (Exists, Changed):  # another writer's change first: start again from it
            time.sleep(random.uniform(0, min(0.2, 0.005 * 2 ** min(attempt, 6))))
    raise OSError(f"{store.uri}/{key}: {TRIES} writers got there first; nothing written")


def mirror(store: Store, into: Path, whole: Callable[[int], bool] = lambda v: True, *,
           keys: list[str] | None = None, etags: dict[str, str] | None = None) -> Path:
    """The model's records and complete versions copied into INTO (a repository's model
    folder), each version that is not there yet by one rename; of a version that WHOLE
    rejects, only its manifest. Versions gone from the store go from INTO. Returns INTO.
    KEYS: the store's keys, when the caller listed them already; ETAGS: the records'
    ETags of the last mirror, kept up to date, so that an unchanged record costs a 304."""
    into.mkdir(parents=True, exist_ok=True)
    found = numbered(store.list() if keys is None else keys)
    complete = {v: files for v, files in found.items() if MANIFEST in files}
    for v, files in sorted(complete.items()):
        target = into / str(v)
        wanted = sorted(f for f in files if f != CLAIM) if whole(v) else [MANIFEST]
        if target.is_dir() and all((target / f).is_file() for f in wanted):
            continue
        with records.building(into) as tmp:
            for name in wanted:
                (tmp / name).write_bytes(store.read(f"{v}/{name}").data)
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
    for old in into.iterdir():
        if old.is_dir() and old.name.isdigit() and int(old.name) not in complete:
            shutil.rmtree(old, ignore_errors=True)
    etags = {} if etags is None else etags
    for name in RECORDS:
        try:
            known = etags.get(name) if (into / name).is_file() else None
            blob = store.read(name) if known is None else store.read_if_changed(name, known)
        except FileNotFoundError:
            etags.pop(name, None)
            with contextlib.suppress(FileNotFoundError):
                (into / name).unlink()
            continue
        if blob is None:  # unchanged since the last mirror
            continue
        data = blob.data
        records.atomic_write(into / name, lambda tmp: tmp.write_bytes(data))  # noqa: B023
        etags[name] = blob.etag
    return into
