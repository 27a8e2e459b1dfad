"""The storage interface on a local folder: conditional writes under the folder's one
lock (``records.locked``), every write atomic (``records.atomic_write``), ETags the
sha256 of the bytes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path

from .. import records
from .store import Blob, Changed, Exists, check_key


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Local:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.uri = str(root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def read(self, key: str) -> Blob:
        data = self._path(key).read_bytes()
        return Blob(data, _etag(data))

    def read_if_changed(self, key: str, etag: str) -> Blob | None:
        blob = self.read(key)
        return None if blob.etag == etag else blob

    def write(self, key: str, data: bytes) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        records.atomic_write(path, lambda tmp: tmp.write_bytes(data))
        return _etag(data)

    def write_if_absent(self, key: str, data: bytes) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            tmp.write_bytes(data)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic, and refused when PATH exists
            except FileExistsError:
                raise Exists(key) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        records.fsync_dir(path.parent)
        return _etag(data)

    def write_if_unchanged(self, key: str, data: bytes, etag: str) -> str:
        path = self._path(key)
        with records.locked(path.parent):
            try:
                current = _etag(path.read_bytes())
            except FileNotFoundError:
                raise Changed(key) from None
            if current != etag:
                raise Changed(key)
            return self.write(key, data)

    def list(self, prefix: str = "") -> list[str]:
        keys = []
        for folder, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if not d.startswith(".tmp-")]  # a version being built
            for name in files:
                if name == records.LOCK or name.endswith(".tmp"):  # the lock, a write's temp
                    continue
                key = Path(folder, name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def check(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"{self.uri!r} is not a folder")
