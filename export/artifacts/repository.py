"""Publishing into a model repository, REPO/<name>/<version>/, torch-free.

A version is built in a hidden temporary directory beside its final place and
appears by one atomic rename, so a reader (the service) never sees a partial one.
Version numbers are integers that only grow: the next one is above every existing
version and above the last one ever published (REPO/<name>/.last_version).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from . import records
from .numbers import is_integer

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name) or ".." in name:
        raise ValueError(f"name must be 1-128 letters, digits, '_', '-' or '.', starting with "
                         f"a letter or digit (no path separators); got {name!r}")
    return name


def versions(model_dir: str | Path) -> list[int]:
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


def publish(repo: str | Path, name: str, build: Callable[[Path, int], None]) -> Path:
    """Call build(tmp_dir, version) to fill a new version, then rename it into place.
    Returns REPO/NAME/<version>. On any error nothing visible is left behind."""
    model_dir = Path(repo) / check_name(name)
    model_dir.mkdir(parents=True, exist_ok=True)
    tmp = model_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
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
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


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
    path = Path(model_dir) / PROMOTION
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {"version": None, "history": []}
    except (OSError, ValueError) as error:
        raise ValueError(f"{str(path)!r} cannot be read: {error}") from None
    version = data.get("version") if isinstance(data, dict) else None
    if not is_integer(version) or version < 1:
        raise ValueError(f"{str(path)!r}: 'version' must be a positive integer; got {version!r}")
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
    model_dir = Path(model_dir)
    now = dt.datetime.now(dt.UTC)

    def change(path: Path) -> dict:
        note = reason
        try:
            record = read_promotion(model_dir)
        except ValueError as error:  # kept for a person; the history starts over
            kept = path.with_name(f"{PROMOTION}.unreadable-{now.strftime('%Y%m%dT%H%M%S.%fZ')}")
            shutil.copyfile(path, kept)
            record = {"version": None, "history": []}
            note = f"{reason} ({error}; kept as {kept.name})".lstrip()
        entry = {"version": version, "action": action,
                 "time": now.isoformat(timespec="seconds"), "reason": note,
                 "previous": record["version"]}
        return {"version": version, "history": [*record["history"], entry]}
    result: dict = records.update_json(model_dir, PROMOTION, change)
    return result


def keep_rejected(repo: str | Path, name: str, build: Callable[[Path, int], None],
                  record: dict) -> Path:
    """Keep a refused candidate for a person to inspect: build(tmp, 0) fills it (version
    0: it never gets a number), ``record`` (why it was refused, its lineage) is written
    to gate.json, and it appears as REPO/NAME/rejected/<time>-<id>/ by one rename."""
    folder = Path(repo) / check_name(name) / REJECTED
    folder.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    tmp = folder / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        build(tmp, 0)
        (tmp / "gate.json").write_text(json.dumps(record, indent=2) + "\n")
        target = folder / f"{stamp}-{uuid.uuid4().hex[:6]}"
        os.rename(tmp, target)
        return target
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def rejected(model_dir: str | Path) -> list[Path]:
    """The kept refused candidates of model_dir, oldest first."""
    folder = Path(model_dir) / REJECTED
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def rollback(model_dir: str | Path, to: int | None = None) -> dict:
    """Move the promotion of model_dir back: to ``to``, or one step (the version promoted
    before the current one, else the newest below it). The target must be on disk and
    verify (sha256 and golden outputs); ValueError names the versions that could be used.
    Decided and written under the model's lock (``records.locked``), so that the step back
    is from the promotion as it is, never from one another writer has just replaced. An
    unreadable promotion.json takes an explicit ``to`` (it is replaced, a copy kept).
    Returns {"model", "promoted", "previous"} (previous None: the file was unreadable)."""
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


def add_model_flags(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """--repo and --name, which ``model_dir_of`` reads (checked there, for one message that
    names every flag missing)."""
    need = " (required)" if required else ""
    parser.add_argument("--repo", help=f"model repository root{need}")
    parser.add_argument("--name", help=f"model name in the repository{need}")


def model_dir_of(args: argparse.Namespace) -> Path:
    """REPO/NAME of --repo and --name, which must name an existing model."""
    missing = [flag for flag, v in (("--repo", args.repo), ("--name", args.name)) if not v]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    model_dir = Path(args.repo) / check_name(args.name)
    if not model_dir.is_dir():
        raise ValueError(f"no model {args.name!r} in {args.repo!r} (--repo, --name)")
    return model_dir
