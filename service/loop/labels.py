"""Labels given back for captured requests (docs/capture.md, "Labels"): validation against
the manifest of the version that answered, and the store (JSON lines beside the captures,
``DIR/<model>/labels/<YYYY-MM-DD>/<replica>-1.jsonl``), over the index of captured and
labelled ids (``index``). ``POST /v2/models/{name}/labels`` (``LabelStore.add_body``) and
``orthornn labels import`` (``LabelStore.add``) share all of it; what ``orthornn capture
dataset`` and the retraining trigger read is ``export.artifacts.loop.captures``.

A batch of labels is all or nothing: every label is checked before one ``write`` appends
them all, under an flock of the replica's file (a torn line a crash left is skipped by
every reader and fenced off by the next write). On a bucket (``--capture s3://...``) a
batch is one new object (``<replica>-<ns>.jsonl``: no append on object storage), and the
index reads a local copy of the bucket's objects, synced by listing at most once a second,
beside this replica's spool."""

from __future__ import annotations

import datetime as dt
import fcntl
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from orthornn.export.artifacts.loop.captures import (
    LABELS,
    REQUEST_ID_RULE,
    is_request_id,
    mirror_captures,
    replica_name,
)
from orthornn.export.artifacts.manifest import Manifest
from orthornn.export.artifacts.package import read_manifest
from orthornn.export.artifacts.records import atomic_write
from orthornn.export.artifacts.repository import check_name, versions
from orthornn.export.artifacts.storage import Exists, is_object_uri, local_folder, open_store
from orthornn.export.artifacts.vocabulary import UNK, words

from ..errors import ClientError, NotFound, StoreUnavailable
from .index import MAX_INDEXED_IDS, CaptureIndex

if TYPE_CHECKING:  # (the store runs without prometheus_client too: orthornn labels import)
    from ..metrics import Metrics

MAX_LABELS = 10_000  # labels in one request (or one import batch)
MAX_TOKENS = 4_096  # next tokens in one language-model label (per sequence)
_MANIFESTS = 64  # manifests kept (versions are immutable: never re-read)
_SYNC_S = 1.0  # on a bucket: the index's copy of today and yesterday listed this often
_FULL_SYNC_S = 300.0  # and all of it (a new version's folder, the retention's deletions)


class LabelError(ClientError):
    """A bad label: the item's INDEX in the batch (its line, for an import) and FIELD."""

    def __init__(self, message: str, status: int, index: int | None = None,
                 field: str | None = None):
        self.index, self.field, self.reason = index, field, message
        where = "" if index is None else f"[{index}]" + (f".{field}" if field else "")
        super().__init__(f"{where}: {message}" if where else message, status)


# -- reading -------------------------------------------------------------------------------


# -- validation against the version that answered -----------------------------------------

@dataclass(frozen=True)
class _Version:
    """What a label of one model version may be: its task, classes, vocabulary."""

    name: str
    version: int
    task: str
    classes: list[str]  # classify: the class names (str(i) where the manifest has none)
    vocabulary: dict[str, int] | None = None  # lm: word -> token id
    vocabulary_size: int = 0

    @classmethod
    def of(cls, package: Path, manifest: Manifest) -> _Version:
        size = manifest.output_spec.size
        if manifest.task == "lm":
            names = (package / str(manifest.vocabulary_file)).read_text().split("\n")
            if names and names[-1] == "":
                names.pop()
            return cls(manifest.name, manifest.version, "lm", [],
                       {w: i for i, w in enumerate(names)}, size)
        names = [str(v) for v in manifest.labels or []]
        return cls(manifest.name, manifest.version, manifest.task,
                   names if len(names) == size else [str(i) for i in range(size)])

    def where(self) -> str:
        return f"model {self.name!r} version {self.version}"

    def check(self, label: Any, sequences: int) -> Any:
        """LABEL normalised (class indices, token ids) for a record of SEQUENCES
        sequences; ValueError naming what is allowed."""
        if self.task not in ("classify", "lm"):
            raise ValueError(f"{self.where()} (task {self.task}) takes no labels: labels are "
                             f"class indices or names (classify) or next tokens (lm)")
        one = self._class if self.task == "classify" else self._tokens
        if sequences == 1:
            if self.task == "classify" and isinstance(label, list):
                if len(label) != 1:
                    raise ValueError(f"the request had 1 sequence: one class, not a list of "
                                     f"{len(label)}")
                label = label[0]
            if self.task == "lm" and isinstance(label, list) and label and \
                    all(isinstance(v, list) for v in label):
                if len(label) != 1:
                    raise ValueError(f"the request had 1 sequence: one list of next tokens, "
                                     f"not {len(label)}")
                label = label[0]
            return one(label)
        if not isinstance(label, list) or len(label) != sequences:
            got = f"a list of {len(label)}" if isinstance(label, list) else type(label).__name__
            raise ValueError(f"the request had {sequences} sequences: a list of {sequences} "
                             f"labels, one per sequence in order; got {got}")
        return [one(v) for v in label]

    def _class(self, value: Any) -> int:
        count = len(self.classes)
        if isinstance(value, int) and not isinstance(value, bool):
            if 0 <= value < count:
                return value
            raise ValueError(f"class index {value} is outside 0..{count - 1} ({self.where()} "
                             f"has {count} classes)")
        if isinstance(value, str):
            if value in self.classes:
                return self.classes.index(value)
            shown = ", ".join(repr(c) for c in self.classes[:20]) + \
                (", ..." if count > 20 else "")
            raise ValueError(f"{value[:100]!r} is not a class of {self.where()}: one of "
                             f"{shown}, or an index 0..{count - 1}")
        raise ValueError(f"a class index (0..{count - 1}) or a class name; got "
                         f"{type(value).__name__}")

    def _tokens(self, value: Any) -> list[int]:
        assert self.vocabulary is not None
        if isinstance(value, str):
            value = words(value)
        if not isinstance(value, list) or not value:
            raise ValueError("the next tokens: a non-empty list of token ids or words, or "
                             "text")
        if len(value) > MAX_TOKENS:
            raise ValueError(f"at most {MAX_TOKENS} next tokens; got {len(value)}")
        ids = []
        for token in value:
            if isinstance(token, int) and not isinstance(token, bool):
                if not 0 <= token < self.vocabulary_size:
                    raise ValueError(f"token id {token} is outside 0..{self.vocabulary_size - 1}"
                                     f" (the vocabulary of {self.where()})")
                ids.append(token)
            elif isinstance(token, str):
                found = self.vocabulary.get(token, self.vocabulary.get(UNK))
                if found is None:
                    raise ValueError(f"word {token[:100]!r} is not in the vocabulary of "
                                     f"{self.where()}, which has no {UNK}")
                ids.append(found)
            else:
                raise ValueError(f"a token id or a word; got {type(token).__name__}")
        return ids


# -- the store -----------------------------------------------------------------------------

def today(now: float) -> str:
    return dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%d")


class LabelStore:
    """Labels of the captures under ROOT (a folder, or ``s3://BUCKET/PREFIX`` with SPOOL,
    this replica's spool, if it serves), checked against the packages of the model
    repository REPO, written as REPLICA (capture's claimed name: no two replicas share a
    file); SOURCE: "api" or "import". Thread-safe: one batch at a time per process."""

    def __init__(self, root: Path | str, repo: Path, replica: str | None = None,
                 metrics: Metrics | None = None, *, source: str = "api",
                 spool: Path | None = None, max_ids: int = MAX_INDEXED_IDS,
                 clock: Callable[[], float] = time.time):
        self.bucket = open_store(str(root).rstrip("/"), "--capture") \
            if is_object_uri(str(root)) else None
        self.root = local_folder(self.bucket.uri, "captures") if self.bucket else Path(root)
        self.roots = (self.root,) if spool is None else (self.root, Path(spool))
        self._synced: dict[str, float] = {}  # model -> when its copy was last listed
        self._full: dict[str, float] = {}  # model -> when all of it was last listed
        self.repo, self.metrics = Path(repo), metrics
        self.replica, self.source, self.max_ids, self.clock = \
            replica_name(replica, f"import-{socket.gethostname()}-{os.getpid()}"), source, \
            max_ids, clock
        self._indexes: dict[str, CaptureIndex] = {}
        self._versions: OrderedDict[tuple[str, int], _Version] = OrderedDict()
        self._lock = threading.Lock()

    def index(self, model: str) -> CaptureIndex:
        found = self._indexes.get(model)
        if found is None:
            found = self._indexes[model] = CaptureIndex(self.roots, model, self.max_ids)
        now = time.monotonic()
        if self.bucket is not None and now - self._synced.get(model, -_SYNC_S) >= _SYNC_S:
            whole = now - self._full.get(model, -_FULL_SYNC_S) >= _FULL_SYNC_S
            wall = self.clock()
            # an object uploaded since the last listing is in today's folder or
            # yesterday's (a segment closes within its age), save a predecessor's
            # leftovers: the whole listing's, every _FULL_SYNC_S
            try:
                mirror_captures(self.bucket, self.root, model, days=None if whole else
                                (today(wall - 86400), today(wall)),
                                versions=tuple(versions(self.repo / model)))
            except Exception as error:  # obstore's and the disk's errors alike
                raise self._unavailable(error) from None
            self._synced[model] = now
            if whole:
                self._full[model] = now
        found.refresh()
        return found

    def _unavailable(self, error: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"the capture bucket {self.bucket.uri if self.bucket else ''}"
                                f" could not be used ({str(error)[:200]}); no label was "
                                f"stored: send them again")

    def _version(self, model: str, version: int) -> _Version:
        key = (model, version)
        found = self._versions.get(key)
        if found is None:
            package = self.repo / model / str(version)
            manifest = read_manifest(package)  # PackageError (a ValueError) when gone
            found = self._versions[key] = _Version.of(package, manifest)
            if len(self._versions) > _MANIFESTS:
                self._versions.popitem(last=False)
        return found

    def add_body(self, model: str, body: bytes) -> dict:
        """POST /v2/models/{name}/labels: the body's labels, all or none."""
        try:
            items = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise ClientError("body is not valid JSON: a list of {\"id\", \"label\"} "
                              "objects") from None
        if not isinstance(items, list):
            raise ClientError("body: must be a JSON list of {\"id\", \"label\"} objects")
        return {"model": model, "accepted": self.add(model, items)}

    def add(self, model: str, items: list, limit: int | None = MAX_LABELS) -> int:
        """Check every label of ITEMS ([{"id", "label"}], at most LIMIT: None for an
        import, whose file the reader bounds), then append them all with one write; the
        count. LabelError (its index and field) on the first bad one, and then nothing is
        written."""
        try:
            check_name(model)
        except ValueError as error:
            raise NotFound(f"model: {error}") from None
        if not (self.repo / model).is_dir():
            raise NotFound(f"model {model!r} is not in the model repository")
        if not items:
            raise ClientError("body: an empty list (give at least one {\"id\", \"label\"})")
        if limit is not None and len(items) > limit:
            raise ClientError(f"body: at most {limit} labels per request; got "
                              f"{len(items)} (send them in several requests)")
        seen: dict[str, int] = {}
        for i, item in enumerate(items):
            if not isinstance(item, dict) or "id" not in item or "label" not in item:
                raise LabelError('must be an object with "id" and "label"', 400, i)
            extra = sorted(set(item) - {"id", "label"})
            if extra:
                raise LabelError(f"unknown field {extra[0]!r} (an item has id and label)",
                                 400, i)
            rid = item["id"]
            if not isinstance(rid, str) or not is_request_id(rid):
                raise LabelError(f"{REQUEST_ID_RULE} (the request's X-Request-Id)", 400, i,
                                 "id")
            if rid in seen:
                raise LabelError(f"{rid!r} appears twice in the request (also at "
                                 f"[{seen[rid]}]): one label per id", 400, i, "id")
            seen[rid] = i
        with self._lock:  # checked and written as one: no second batch between
            index = self.index(model)
            lines = []
            now = self.clock()
            for i, item in enumerate(items):
                rid = item["id"]
                record = index.record(rid)
                if record is None:
                    raise LabelError(f"{rid!r} was not captured for model {model!r} (or its "
                                     f"day is past the capture retention, or older than the "
                                     f"newest {self.max_ids:,} captures the index holds)",
                                     422, i, "id")
                if rid in index.labelled:
                    raise LabelError(f"{rid!r} is already labelled (a label is given once)",
                                     409, i, "id")
                if index.ambiguous(rid):
                    raise LabelError(f"{rid!r} was captured for two requests with different "
                                     f"inputs (another client sent this id); it cannot be "
                                     f"labelled. Clients that do not send X-Request-Id get "
                                     f"an id the server draws (docs/capture.md)", 409, i, "id")
                try:
                    version = self._version(model, int(record["version"]))
                except (ValueError, OSError) as error:
                    raise LabelError(f"{rid!r} was answered by version {record['version']}, "
                                     f"whose package cannot be read ({error})", 422, i,
                                     "id") from None
                try:
                    label = version.check(item["label"], len(record.get("inputs") or [1]))
                except ValueError as error:
                    raise LabelError(str(error), 422, i, "label") from None
                lines.append(orjson.dumps({"id": rid, "label": label,
                                           "time": round(now, 6), "source": self.source},
                                          option=orjson.OPT_APPEND_NEWLINE))
            self._append(model, b"".join(lines), now)
            index.labelled.update(seen)
        if self.metrics is not None:
            self.metrics.labels_received.labels(model).inc(len(items))
        return len(items)

    def _append(self, model: str, data: bytes, now: float) -> None:
        """DATA (whole lines) at the end of this replica's file of the day, one write under
        an flock; a torn last line a crash left is closed by a newline first, so that it
        stays one bad line that readers skip. On a bucket: one new object, then the same
        bytes in the index's copy."""
        if self.bucket is not None:
            key = f"{model}/{LABELS}/{today(now)}/{self.replica}-{time.time_ns()}.jsonl"
            try:
                try:
                    self.bucket.write_if_absent(key, data)
                except Exists:  # the same nanosecond on a clock that went back: once more
                    key = key.replace(".jsonl", f"-{os.getpid()}{threading.get_ident()}.jsonl")
                    self.bucket.write_if_absent(key, data)
            except Exception as error:
                raise self._unavailable(error) from None
            (self.root / key).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.root / key, lambda tmp: tmp.write_bytes(data))
            return
        folder = self.root / model / LABELS / today(now)
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / f"{self.replica}-1.jsonl",
                     os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)  # the lock goes with it
