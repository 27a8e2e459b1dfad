"""The storage interface, the errors of its conditional writes, and the one rule that
tells a bucket's URI from a folder's path (docs/design.md, "Storage").

A key is a relative, "/"-separated name under the store's root (a folder, or a bucket's
prefix). An ETag is opaque: what ``read`` returned is what ``write_if_unchanged`` takes.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

SCHEMES = ("s3",)
# a URI's scheme, with its "//" (s3://b/p) or collapsed to one slash by a path join
# (Path("s3://b/p") is "s3:/b/p": what the export command once published into, locally)
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/")
# S3's bucket naming rules: 3-63 lower-case letters, digits, dots and hyphens, starting
# and ending with a letter or a digit
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class Blob:
    """An object's bytes and the ETag they were read with."""

    data: bytes
    etag: str


class Exists(Exception):
    """write_if_absent: the key exists already (S3's 412 to If-None-Match: *)."""


class Changed(Exception):
    """write_if_unchanged: the object is not the one read (another writer replaced or
    removed it; S3's 412 to If-Match)."""


class Store(Protocol):
    uri: str

    def read(self, key: str) -> Blob:
        """The object at KEY; FileNotFoundError when there is none."""
        ...

    def read_if_changed(self, key: str, etag: str) -> Blob | None:
        """The object at KEY if its ETag is not ETAG, else None (S3: a conditional GET
        answered 304, nothing downloaded); FileNotFoundError when there is none."""
        ...

    def write(self, key: str, data: bytes) -> str:
        """Replace (or create) KEY's object, all or nothing; returns its ETag."""
        ...

    def write_if_absent(self, key: str, data: bytes) -> str:
        """Create KEY's object; Exists when there is one. Returns its ETag."""
        ...

    def write_if_unchanged(self, key: str, data: bytes, etag: str) -> str:
        """Replace KEY's object if it is still the one read with ETAG; Changed if not."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Every key under PREFIX (recursive), sorted."""
        ...

    def delete(self, key: str) -> None:
        """Remove KEY's object (none there: nothing to do)."""
        ...

    def check(self) -> None:
        """ValueError (one line, naming the location) when the store cannot be used:
        a missing bucket, refused credentials, an endpoint that does not answer."""
        ...


def is_object_uri(location: object) -> bool:
    """Whether LOCATION is a URI (``s3://...``) rather than a local path."""
    return isinstance(location, str) and _URI.match(location) is not None


def check_location(location: str, setting: str) -> str:
    """LOCATION as given when it is a local path or a well-formed ``s3://bucket[/prefix]``
    URI; ValueError naming SETTING otherwise (another scheme, one slash, no bucket)."""
    match = _URI.match(location)
    if match is None:
        return location
    scheme = match.group(1).lower()
    if scheme not in SCHEMES:
        raise ValueError(f"{setting}: {location!r} is a {scheme}:// URI; a location is a "
                         f"local folder or s3://BUCKET[/PREFIX]")
    if not location.startswith(f"{match.group(1)}://"):
        raise ValueError(f"{setting}: {location!r} is not a URI (s3://BUCKET[/PREFIX], two "
                         f"slashes) nor a folder")
    bucket, _, prefix = location[len("s3://"):].partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(f"{setting}: {location!r}: the bucket must be 3-63 lower-case "
                         f"letters, digits, '.' or '-' (s3://BUCKET[/PREFIX]); got "
                         f"{bucket!r}")
    if any(part in ("", ".", "..") for part in prefix.rstrip("/").split("/")) and prefix.strip("/"):
        raise ValueError(f"{setting}: {location!r}: the prefix has an empty, '.' or '..' "
                         f"part")
    return location


def split_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at its ends) of a checked ``s3://`` URI."""
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


def check_key(key: str) -> str:
    """KEY when it is relative with no empty, '.' or '..' part; ValueError otherwise."""
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"storage key {key!r} must be relative, without empty, '.' or '..' "
                         f"parts")
    return key


def join(location: str, *parts: str) -> str:
    """LOCATION/PART/..., a URI kept a URI (never through pathlib, which folds "//")."""
    return "/".join([location.rstrip("/"), *parts])


def local_folder(uri: str, kind: str) -> Path:
    """Where a bucket's local copy (a repository's mirror, a capture's spool or copy)
    lives by default: orthornn-KIND-<its URI's hash> in the temporary folder, one per
    bucket and use, the same at every start."""
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"orthornn-{kind}-{digest}"


def folder_only(location: str | Path, setting: str) -> Path:
    """LOCATION as a Path, for a setting that takes a local folder only (a cache, a
    spool); ValueError naming SETTING for a bucket's URI (or a malformed one)."""
    text = check_location(str(location), setting)
    if is_object_uri(text):
        raise ValueError(f"{setting}: {text} is a bucket; {setting} takes a local folder")
    return Path(text)
