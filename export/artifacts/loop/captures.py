"""The capture folder's format, read side (docs/capture.md): the records ``orthornn serve
--capture DIR`` writes, ``DIR/<model>/<version>/<YYYY-MM-DD>/<replica>-<n>.jsonl`` (``.open``
while written), their arrays, and the labels given back beside them,
``DIR/<model>/labels/<YYYY-MM-DD>/<replica>-1.jsonl``. Written once here for the service
(capture, labels) and for the retraining job's commands (capture dataset, monitor,
retrain-trigger), which run in the training image: numpy and orjson only, no server.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..repository import check_name
from ..scoring import softmax

OPEN = ".open"  # the suffix of the segment a replica is writing
#: the empty file an uploaded segment leaves in a replica's spool (capture on a bucket):
#: its number stays taken
UPLOADED = ".uploaded"
LABELS = "labels"  # DIR/<model>/labels/: beside the version folders

#: a request's id (its X-Request-Id, the OIP request's ``id``, a label's ``id``): what an
#: answer header, a JSON line and a log line hold as they are
REQUEST_ID_RULE = "1 to 128 printable ASCII characters, no spaces"
_PRINTABLE = bytes(range(0x21, 0x7F))
_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")  # a day folder's name (UTC)


def fingerprint(record: dict[str, Any]) -> bytes:
    """What identifies a captured request's inputs (a digest of each input's dtype, shape
    and bytes): a retry, captured twice under its id, has one; two clients' requests under
    one id (a squatted id) have two, and then the id is labelled by neither (docs/capture.md,
    "Whose id")."""
    digest = hashlib.blake2b(digest_size=16)
    for value in record.get("inputs") or []:
        a = np.ascontiguousarray(array(value))
        digest.update(f"{a.dtype.str}{a.shape};".encode())
        digest.update(a.tobytes())
    return digest.digest()


def is_request_id(value: bytes | str) -> bool:
    """Whether VALUE keeps REQUEST_ID_RULE."""
    if isinstance(value, str):
        if not value.isascii():
            return False
        value = value.encode("ascii")
    return 0 < len(value) <= 128 and not value.translate(None, _PRINTABLE)


def array(value: dict[str, Any] | np.ndarray) -> np.ndarray:
    """The array a record holds: its dtype, shape and little-endian bytes in base64 (as a
    line holds it), or the array itself (as ``records_of`` gives a batch's)."""
    if isinstance(value, np.ndarray):
        return value
    data = base64.b64decode(value["b64"])
    return np.frombuffer(data, dtype=np.dtype(value["dtype"])).reshape(value["shape"])


def records_of(value: Any) -> list[dict[str, Any]]:
    """The records of one parsed line, one per request: a line of one request (a session's
    chunk) as it is; a batch's line (``ids``: its sampled requests, service.loop.capture) split
    into theirs, each with the fields a request's line has: ``inputs`` a list of arrays,
    ``outputs`` one item per sequence (a classifier's ``index`` and ``probabilities``, a
    language model's ``log_likelihood``, else the graph's output by its name). A value
    that is neither gives none."""
    if not isinstance(value, dict):
        return []
    if "ids" not in value:
        return [value] if "id" in value else []
    lengths = value["lengths"]
    cuts = np.cumsum(lengths)[:-1]
    inputs = np.split(array(value["inputs"]), cuts)
    kind, name, out = value["outputs"]["kind"], value["outputs"]["name"], \
        array(value["outputs"]["value"])
    if kind == "classify":  # the probabilities /predict answered: its float64 softmax
        items: list[dict] = [{"index": int(row.argmax()), "probabilities": row.tolist()}
                             for row in softmax(out.astype(np.float64))]
    elif kind == "lm":
        items = [{"log_likelihood": float(v)} for v in out]
    else:  # "steps": a row per step of each sequence; "rows": one per sequence
        items = [{name: row} for row in (np.split(out, cuts) if kind == "steps" else out)]
    records, start = [], 0
    for rid, route, count, compute in zip(value["ids"], value["routes"], value["sequences"],
                                          value["compute_ms"], strict=True):
        records.append({"id": rid, "time": value["time"], "route": route,
                        "model": value["model"], "version": value["version"],
                        "inputs": inputs[start:start + count],
                        "outputs": items[start:start + count], "session": None,
                        "position": None, "compute_ms": compute})
        start += count
    return records


def line_records(line: bytes) -> list[dict[str, Any]] | None:
    """The records of one line of a segment; None for a line that is not whole JSON (a
    torn last line of a killed writer)."""
    try:
        return records_of(orjson.loads(line))
    except orjson.JSONDecodeError:
        return None


def segments(root: Path, model: str, since: dt.datetime | None = None) -> list[Path]:
    """MODEL's segments under ROOT, closed and open, in name order (version folders only:
    the labels folder beside them is not one); SINCE: of its UTC day and later."""
    day = None if since is None else since.astimezone(dt.UTC).date().isoformat()
    return sorted(p for p in (Path(root) / model).glob("*/*/*.jsonl*")
                  if p.parent.parent.name.isdigit()
                  and (p.name.endswith(".jsonl") or p.name.endswith(".jsonl" + OPEN))
                  and (day is None or p.parent.name >= day))


def local_captures(location: str | Path, model: str, show: bool = False) -> Path:
    """The capture folder of LOCATION (``--capture``): a folder as it is; of a bucket
    (``s3://...``), a local copy of MODEL's segments and labels, kept in the temporary
    folder under a name of the URI's hash, where each object not yet there is downloaded
    (a segment's object is written once and never changed: its name is enough) and a file
    whose object is gone (the retention) removed. ValueError naming --capture when the
    folder is missing or the bucket cannot be read."""
    from ..storage import check_location, is_object_uri, local_folder, open_store

    text = check_location(str(location), "--capture")
    if not is_object_uri(text):
        if not Path(text).is_dir():
            raise ValueError(f"--capture: {text!r} is not a folder")
        return Path(text)
    uri = text.rstrip("/")
    store = open_store(uri, "--capture")
    store.check()
    root = local_folder(uri, "captures")
    mirror_captures(store, root, model, show)
    return root


def mirror_captures(store: Any, root: Path, model: str, show: bool = False,
                    days: tuple[str, ...] | None = None, versions: tuple[int, ...] = ()
                    ) -> None:
    """ROOT made a copy of MODEL's segments and labels in STORE (``local_captures``):
    the objects not yet there downloaded, the files whose object is gone removed.
    DAYS: only those day folders (``YYYY-MM-DD``) of the copy's version folders and of the
    labels, and of VERSIONS (the repository's: a version whose first captures are not in
    the copy yet), one listing each (the labels' index follows new objects every second:
    a listing of the whole retention there would be tens of thousands of keys), nothing
    removed; None: the whole model. STORE's errors pass through."""
    from ..records import atomic_write

    uri = store.uri
    name = check_name(model)
    if days is None:
        listed = store.list(f"{name}/")
        mine = {p.relative_to(root).as_posix() for p in (root / model).glob("*/*/*.jsonl")}
    else:
        subs = {p.name for p in (root / model).glob("*") if p.is_dir()} | {LABELS} | \
            {str(v) for v in versions}
        listed = [k for sub in sorted(subs) for day in days
                  for k in store.list(f"{name}/{sub}/{day}/")]
        mine = {p.relative_to(root).as_posix() for day in days
                for p in (root / model).glob(f"*/{day}/*.jsonl")}
    keys = {k for k in listed if _is_capture_key(k)}
    missing = sorted(keys - mine)
    bar = progress_bar(len(missing), f"{model}: from {uri}", "file", show)
    for key in missing:
        data = store.read(key).data
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(root / key, lambda tmp: tmp.write_bytes(data))  # noqa: B023
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    if days is None:
        for gone in mine - keys:
            (root / gone).unlink(missing_ok=True)


def _is_capture_key(key: str) -> bool:
    """A segment's or a label file's key: MODEL/<version or labels>/<day>/<name>.jsonl."""
    parts = key.split("/")
    return len(parts) == 4 and (parts[1].isdigit() or parts[1] == LABELS) and \
        _DAY.fullmatch(parts[2]) is not None and parts[3].endswith(".jsonl") and \
        not parts[3].startswith(".")


def replica_name(given: str | None, default: str) -> str:
    """A replica's name in segment, label and lock file names: GIVEN checked like a
    model's name (no "..", no leading dot: ``--capture-replica ..`` named a folder;
    ValueError naming the setting), else DEFAULT (the host name, an import's own) made to
    fit that rule."""
    if given is None:
        fitted = re.sub(r"[^A-Za-z0-9._-]", "_", default).replace("..", "__")[:128]
        return fitted if fitted[:1].isalnum() else f"r{fitted}"[:128]
    try:
        return check_name(given)
    except ValueError:
        raise ValueError(f"capture_replica: {given!r} is not 1-128 of A-Z a-z 0-9 . _ -, "
                         "starting with a letter or digit, without '..'") from None


def segment_name(path: Path, root: Path) -> str:
    """A segment's name relative to ROOT, without ``.open`` (it keeps it when it closes)."""
    rel = path.relative_to(root).as_posix()
    return rel[:-len(OPEN)] if rel.endswith(OPEN) else rel


def parse_since(value: str | None) -> dt.datetime | None:
    """``--since`` of the loop's commands: a UTC day (YYYY-MM-DD) or an ISO 8601 time (UTC
    unless it says otherwise); None when not given."""
    if value is None:
        return None
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"--since: {value!r} is not a date (YYYY-MM-DD) or an ISO 8601 "
                         f"time") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def progress_bar(total: int, desc: str, unit: str, show: bool) -> Any:
    """A tqdm bar on stderr (rate and ETA), or None: with SHOW false, or without tqdm (it
    comes with the train extra; the serving image has none)."""
    if not show:
        return None
    try:
        from tqdm import tqdm
    except ModuleNotFoundError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr,
                mininterval=0.5 if sys.stderr.isatty() else 5.0)


def read_records(root: Path, model: str) -> tuple[list[dict[str, Any]], int]:
    """Every record captured for MODEL under ROOT (closed and open segments), and the count
    of lines that are not a whole record (a torn last line of a killed writer)."""
    records, torn = [], 0
    for path in segments(root, model):
        for line in path.read_bytes().splitlines():
            found = line_records(line)
            if found is None:
                torn += 1
            else:
                records.extend(found)
    return records, torn


def label_lines(data: bytes) -> Iterator[dict]:
    """The label lines of a label file's bytes; a torn line a crash left is skipped."""
    for line in data.splitlines():
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(value, dict) and "id" in value and "label" in value:
            yield value


def label_files(root: Path, model: str) -> list[Path]:
    return sorted((Path(root) / model / LABELS).glob("*/*.jsonl"))


def read_labels(root: Path, model: str) -> list[dict]:
    """Every label line of MODEL under the capture folder ROOT: {"id", "label" (a class
    index, a list of them, or token ids), "time" (Unix seconds), "source" ("api" or
    "import")}, in file order (day, then replica); torn lines skipped."""
    return [{"id": v["id"], "label": v["label"], "time": v.get("time"),
             "source": v.get("source")}
            for path in label_files(root, model) for v in label_lines(path.read_bytes())]


def first_labels(root: Path, model: str) -> tuple[dict[str, dict], int]:
    """MODEL's label lines by request id, the earliest (by its time) of an id labelled
    twice (two replicas at once), and how many later ones were left out."""
    labels: dict[str, dict] = {}
    duplicates = 0
    for line in sorted(read_labels(root, model), key=lambda v: v.get("time") or 0.0):
        if line["id"] in labels:
            duplicates += 1
        else:
            labels[line["id"]] = line
    return labels, duplicates
