"""Publishing into a model repository, REPO/<name>/<version>/, torch-free.

A version is built in a hidden temporary directory beside its final place and
appears by one atomic rename, so a reader (the service) never sees a partial one.
Version numbers are integers that only grow: the next one is above every existing
version and above the last one ever published (REPO/<name>/.last_version).

REPO may be a bucket (``s3://bucket/prefix``): then a model's location is a URI string,
not a Path, and each function here does the same through ``remote`` (claimed numbers,
the manifest last, records replaced if unchanged); ``local_model`` gives a folder to
read its packages from.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from . import records, remote
from .numbers import is_integer
from .storage import check_location, is_object_uri, open_store
from .storage.store import join

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name) or ".." in name:
        raise ValueError(f"name must be 1-128 letters, digits, '_', '-' or '.', starting with "
                         f"a letter or digit (no path separators); got {name!r}")
    return name


Location = str | Path  # a model's folder, or its URI in a bucket (s3://bucket/prefix/NAME)


def model_location(repo: str | Path, name: str) -> Location:
    """REPO/NAME: a Path for a folder, a URI string for a bucket (never through pathlib,
    which folds s3:// into s3:/)."""
    check_name(name)
    if is_object_uri(str(repo)):
        return join(check_location(str(repo), "--repo"), name)
    return Path(repo) / name


def version_of(location: Location) -> int:
    """The version number a version's location ends with."""
    return int(last_name(location))


@contextmanager
def local_model(model_dir: Location, whole: Callable[[int], bool] = lambda v: True
                ) -> Iterator[Path]:
    """A folder holding MODEL_DIR's versions and records: the folder itself, or for a
    bucket a mirror of it in a temporary folder (``remote.mirror``; a version WHOLE
    rejects with its manifest only), removed afterwards."""
    if not is_object_uri(str(model_dir)):
        yield Path(model_dir)
        return
    with tempfile.TemporaryDirectory(prefix="orthornn-mirror-") as tmp:
        yield remote.mirror(open_store(str(model_dir)), Path(tmp) / last_name(model_dir),
                            whole)


@contextmanager
def local_repo(repo: str | Path, name: str, setting: str = "--repo") -> Iterator[Path]:
    """A folder laid out as a repository that holds REPO's model NAME: REPO itself, or for
    a bucket a mirror of that model (every version, its records) in a temporary folder,
    removed afterwards: for the loop's commands, which read versions' files (manifests,
    references, graphs) as a folder's. A bucket that does not answer: ValueError naming
    SETTING."""
    if not is_object_uri(check_location(str(repo), setting)):
        yield Path(repo)
        return
    location = model_location(repo, name)
    open_store(str(location), setting).check()
    with local_model(location) as model_dir:
        yield model_dir.parent


def last_name(location: Location) -> str:
    """The last name of a location: a model's name, or a version's number."""
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def versions(model_dir: str | Path) -> list[int]:
    if is_object_uri(str(model_dir)):
        return remote.versions(open_store(str(model_dir)))
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def next_version(model_dir: Path) -> int:
    last = 0
    marker = model_dir / ".last_version"
    if marker.is_file():
        text = marker.read_text().strip()
        last = int(text) if text.isdigit() else 0
    return max([last, *versions(model_dir)]) + 1


def publish(repo: str | Path, name: str, build: Callable[[Path, int], None]) -> Location:
    """Call build(tmp_dir, version) to fill a new version, then rename it into place.
    Returns REPO/NAME/<version>. On any error nothing visible is left behind."""
    location = model_location(repo, name)
    if not isinstance(location, Path):
        return join(location, str(remote.publish(open_store(location), build)))
    model_dir = location
    model_dir.mkdir(parents=True, exist_ok=True)
    with records.building(model_dir) as tmp:
        version = next_version(model_dir)
        build(tmp, version)
        for _ in range(100):
            target = model_dir / str(version)
            try:
                os.rename(tmp, target)  # atomic; fails if another publisher took it
            except OSError:
                if not target.exists():
                    raise
                version = next_version(model_dir)
                build(tmp, version)  # the manifest names the version: write it again
                continue
            marker = f"{version}\n"
            records.atomic_write(model_dir / ".last_version",
                                 lambda tmp: tmp.write_text(marker))  # noqa: B023 (called now)
            return target
        raise OSError(f"could not claim a version number in {str(model_dir)!r}")


# -- promotion: which version of a model is live ----------------------------------------
#
# REPO/<name>/promotion.json:
#   {"version": 3, "history": [{"version": 1, "action": "publish", "time": ISO-8601,
#                               "reason": "...", "previous": None}, ...]}
# "version" is the promoted version (what the service serves by default); "history" lists
# every change, oldest first, with its action: publish (an export without --gate),
# promote (an export whose candidate passed --gate, or a rollout's last step), rollback.
# Every writer (export, rollback from the command or the admin API, the rollout) holds the
# model's one lock and replaces the file crash-safe (``records``): a reader never sees a
# partial or empty file. A model without the file has no promotion: the service serves its
# newest verified version (as before promotion existed); a file that is there but cannot be
# read is no promotion of the newest: the service keeps what it serves. Refused candidates
# are kept, for a person to inspect, under REPO/<name>/rejected/<id>/ (not a version
# number, so the service never loads them).

PROMOTION = "promotion.json"
REJECTED = "rejected"
ACTIONS = ("publish", "promote", "rollback")


def read_promotion(model_dir: str | Path) -> dict:
    """{"version": int | None, "history": [...]} of model_dir (version None: none)."""
    if is_object_uri(str(model_dir)):
        data = remote.read_record(open_store(str(model_dir)), PROMOTION)
        return promotion_of(data, join(str(model_dir), PROMOTION))
    path = Path(model_dir) / PROMOTION
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        data = None
    except (OSError, ValueError) as error:
        raise ValueError(f"{str(path)!r} cannot be read: {error}") from None
    return promotion_of(data, str(path))


def promotion_of(data: object, path: str) -> dict:
    if data is None:
        return {"version": None, "history": []}
    version = data.get("version") if isinstance(data, dict) else None
    if not is_integer(version) or version < 1:
        raise ValueError(f"{path!r}: 'version' must be a positive integer; got {version!r}")
    assert isinstance(data, dict)
    return {"version": version, "history": list(data.get("history") or [])}


def promoted(model_dir: str | Path) -> int | None:
    """The promoted version of model_dir, or None (no promotion file, or an unreadable
    one: for the commands' listings and lineage; the service keeps what it serves on an
    unreadable one, ``read_promotion``'s ValueError)."""
    try:
        return read_promotion(model_dir)["version"]
    except ValueError:
        return None


def live_version(on_disk: list[int], promoted_version: int | None) -> int | None:
    """The version a model serves by default, of the versions on disk: the promoted one,
    else (none promoted, or it is gone) the newest; None without versions."""
    if promoted_version in on_disk:
        return promoted_version
    return max(on_disk) if on_disk else None


def promote(model_dir: str | Path, version: int, action: str, reason: str = "") -> dict:
    """Make ``version`` the promoted one and record why; returns the new promotion record.
    Under the model's lock, from the record as it is then (no change of another writer is
    lost), crash-safe (``records.update_json``). An unreadable file is replaced, a copy of
    it kept beside it as promotion.json.unreadable-<time>. The caller has checked that the
    version exists and verifies."""
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {', '.join(ACTIONS)}; got {action!r}")
    now = dt.datetime.now(dt.UTC)
    kept = f"{PROMOTION}.unreadable-{now.strftime('%Y%m%dT%H%M%S.%fZ')}"

    def entry_on(record: dict, note: str) -> dict:
        return with_entry(record, version, action, note, now)

    def unreadable(error: ValueError) -> tuple[dict, str]:  # the history starts over
        return {"version": None, "history": []}, f"{reason} ({error}; kept as {kept})".lstrip()

    if is_object_uri(str(model_dir)):
        store = open_store(str(model_dir))

        def change_object(data: bytes | None) -> dict:
            try:
                record, note = promotion_of(None if data is None else json.loads(data),
                                             join(store.uri, PROMOTION)), reason
            except ValueError as error:  # kept for a person
                store.write(kept, data or b"")
                record, note = unreadable(error)
            return entry_on(record, note)
        object_result: dict = remote.update(store, PROMOTION, change_object)
        return object_result
    model_dir = Path(model_dir)

    def change(path: Path) -> dict:
        try:
            record, note = read_promotion(model_dir), reason
        except ValueError as error:  # kept for a person
            shutil.copyfile(path, path.with_name(kept))
            record, note = unreadable(error)
        return entry_on(record, note)
    result: dict = records.update_json(model_dir, PROMOTION, change)
    return result


def with_entry(record: dict, version: int, action: str, note: str, now: dt.datetime) -> dict:
    """The promotion record with VERSION promoted and the change appended to its history."""
    entry = {"version": version, "action": action, "time": now.isoformat(timespec="seconds"),
             "reason": note, "previous": record["version"]}
    return {"version": version, "history": [*record["history"], entry]}


def keep_rejected(repo: str | Path, name: str, build: Callable[[Path, int], None],
                  record: dict) -> Location:
    """Keep a refused candidate for a person to inspect: build(tmp, 0) fills it (version
    0: it never gets a number), ``record`` (why it was refused, its lineage) is written
    to gate.json, and it appears as REPO/NAME/rejected/<time>-<id>/ by one rename (in a
    bucket: uploaded, gate.json last)."""
    location = model_location(repo, name)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    kept = f"{stamp}-{uuid.uuid4().hex[:6]}"
    if not isinstance(location, Path):
        with tempfile.TemporaryDirectory(prefix="orthornn-rejected-") as building:
            build(Path(building), 0)
            (Path(building) / "gate.json").write_text(json.dumps(record, indent=2) + "\n")
            remote.upload(open_store(location), f"{REJECTED}/{kept}", Path(building),
                          last="gate.json")
        return join(location, REJECTED, kept)
    folder = location / REJECTED
    folder.mkdir(parents=True, exist_ok=True)
    with records.building(folder) as tmp:
        build(tmp, 0)
        (tmp / "gate.json").write_text(json.dumps(record, indent=2) + "\n")
        target = folder / kept
        os.rename(tmp, target)
        return target


def rejected(model_dir: str | Path) -> list[Path]:
    """The kept refused candidates of model_dir, oldest first."""
    folder = Path(model_dir) / REJECTED
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def add_model_flags(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """--repo and --name, which ``model_dir_of`` reads (checked there, for one message that
    names every flag missing)."""
    need = " (required)" if required else ""
    parser.add_argument("--repo", help=f"model repository root{need}")
    parser.add_argument("--name", help=f"model name in the repository{need}")


def model_dir_of(args: argparse.Namespace) -> Location:
    """REPO/NAME of --repo and --name, which must name an existing model (in a bucket:
    one that answers, holding a key under NAME/)."""
    missing = [flag for flag, v in (("--repo", args.repo), ("--name", args.name)) if not v]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    model_dir = model_location(args.repo, args.name)
    if isinstance(model_dir, Path):
        found = model_dir.is_dir()
    else:
        store = open_store(model_dir, "--repo")
        store.check()
        found = bool(store.list())
    if not found:
        raise ValueError(f"no model {args.name!r} in {args.repo!r} (--repo, --name)")
    return model_dir
