"""A model's records in the repository (REPO/<name>/promotion.json and rollout.json): one
writer at a time, and crash-safe replacement. Torch-free; the export command, the rollback
and rollout commands, the admin API and the service's rollout controller all write
through here, so the rule lives once.

- ``locked(model_dir)``: one exclusive lock per model, on REPO/<name>/.lock, across
  processes and pods that share the volume (``fcntl.flock``; on Linux NFS the kernel maps
  it to an NFS byte-range lock: NFSv4, or NFSv3 with lockd/NLM) and across the threads of
  one process (a per-folder thread lock as well: on NFS, flock locks of one process do not
  exclude each other). Re-entrant within a thread (the rollout's final promotion, taken
  while the rollout holds the lock). It does not hold on file systems that ignore or fake
  locks: NFS mounted with ``nolock`` / ``local_lock=all``, some FUSE file systems
  (s3fs, gcsfuse, goofys), SMB without byte-range locks.
- ``replace_json(path, data)``: ``atomic_write``, the one atomic write: a temporary file
  in the same folder, written and fsynced, renamed over PATH, then the folder fsynced: a
  reader (who takes no lock) sees the old file or the new one, never a partial or empty
  one, also after a crash of the writer or of the node.
- ``update_json(model_dir, name, change)``: both, the read done under the lock.
- ``building(folder)``: the hidden temporary folder a tree is built in before its one
  rename into place (publishing, kept candidates, a bucket's mirror).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

LOCK = ".lock"

_guard = threading.Lock()
_thread_locks: dict[str, threading.Lock] = {}  # per model folder, for this process's threads
_held = threading.local()  # the folders this thread holds, with their depth


def _depths() -> dict[str, int]:
    depths = getattr(_held, "depths", None)
    if depths is None:
        depths = _held.depths = {}
    return depths


@contextlib.contextmanager
def locked(model_dir: str | Path) -> Iterator[None]:
    """Hold MODEL_DIR's one lock (blocking until it is free); re-entrant in a thread."""
    key = os.path.realpath(model_dir)
    depths = _depths()
    if key in depths:  # this thread holds it already
        depths[key] += 1
        try:
            yield
        finally:
            depths[key] -= 1
        return
    with _guard:
        thread_lock = _thread_locks.setdefault(key, threading.Lock())
    with thread_lock:
        fd = os.open(os.path.join(key, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o664)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, or the process dies
            depths[key] = 1
            try:
                yield
            finally:
                del depths[key]
        finally:
            os.close(fd)


def holds(model_dir: str | Path) -> bool:
    """Whether this thread holds MODEL_DIR's lock."""
    return os.path.realpath(model_dir) in _depths()


def fsync_dir(folder: str | Path) -> None:
    """Make a rename (or a new file) in FOLDER durable."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> None:
    """WRITE(tmp) a temporary file beside PATH, fsync it, rename it over PATH and fsync the
    folder: a reader sees the old file or the new one, never a partial or empty one, also
    after a crash of the writer or of the node. The one atomic write of the project (the
    repository's records, training's checkpoints and plots, bench results)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # only when the rename did not happen
    fsync_dir(path.parent)


def write_json(path: str | Path, data: Any) -> None:
    """DATA as indented JSON at PATH, by ``atomic_write``."""
    text = json.dumps(data, indent=2) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text))


def replace_json(path: str | Path, data: Any) -> None:
    """``write_json`` of a record; the caller holds the lock, so a killed writer's
    temporary files are removed first: those of every JSON record in the folder, which are
    all written under this lock (a writer killed mid-rollout.json is swept by the next
    promotion too)."""
    path = Path(path)
    for stale in path.parent.glob(".*.json.*.tmp"):
        with contextlib.suppress(OSError):
            stale.unlink()
    write_json(path, data)


def update_json(model_dir: str | Path, name: str, change: Callable[[Path], Any]) -> Any:
    """Under MODEL_DIR's lock: CHANGE(path) reads the record (the current one: read under
    the lock) and returns the new one, which replaces it crash-safe (``replace_json``);
    returns it. CHANGE may raise to write nothing."""
    path = Path(model_dir) / name
    with locked(model_dir):
        data = change(path)
        replace_json(path, data)
    return data


@contextlib.contextmanager
def building(folder: Path) -> Iterator[Path]:
    """A hidden temporary folder in FOLDER for a tree that appears by one rename into
    place (a version, a kept candidate, a mirrored version); removed unless renamed."""
    tmp = folder / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
