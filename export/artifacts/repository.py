"""Publishing into a model repository, REPO/<name>/<version>/, torch-free.

A version is built in a hidden temporary directory beside its final place and
appears by one atomic rename, so a reader (the service) never sees a partial one.
Version numbers are integers that only grow: the next one is above every existing
version and above the last one ever published (REPO/<name>/.last_version).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

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
            marker_tmp = model_dir / f".last_version.{uuid.uuid4().hex[:8]}"
            marker_tmp.write_text(f"{version}\n")
            os.replace(marker_tmp, model_dir / ".last_version")
            return target
        raise OSError(f"could not claim a version number in {str(model_dir)!r}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# -- promotion: which version of a model is live ----------------------------------------
#
# REPO/<name>/promotion.json, replaced atomically (write a temporary file, os.replace):
#   {"version": 3, "history": [{"version": 1, "action": "publish", "time": ISO-8601,
#                               "reason": "..."}, ...]}
# "version" is the promoted version (what the service serves by default); "history" lists
# every change, oldest first, with its action: publish (an export without --gate),
# promote (an export whose candidate passed --gate), rollback. A model without the file
# has no promotion: the service serves its newest verified version (as before promotion
# existed). Refused candidates are kept, for a person to inspect, under
# REPO/<name>/rejected/<id>/ (not a version number, so the service never loads them).

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
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"{str(path)!r}: 'version' must be a positive integer; got {version!r}")
    return {"version": version, "history": list(data.get("history") or [])}


def promoted(model_dir: str | Path) -> int | None:
    """The promoted version of model_dir, or None (no promotion file, or an unreadable
    one: the caller falls back to the newest version)."""
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
    """Make ``version`` the promoted one (atomically) and record why; returns the new
    promotion record. The caller has checked that the version exists and verifies."""
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {', '.join(ACTIONS)}; got {action!r}")
    model_dir = Path(model_dir)
    try:
        record = read_promotion(model_dir)
    except ValueError:  # an unreadable file is replaced, its history lost (logged by caller)
        record = {"version": None, "history": []}
    entry = {"version": version, "action": action,
             "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "reason": reason,
             "previous": record["version"]}
    record = {"version": version, "history": [*record["history"], entry]}
    tmp = model_dir / f".{PROMOTION}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, model_dir / PROMOTION)
    return record


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
    Returns {"model", "promoted", "previous"}."""
    from .package import PackageError, verify_package

    model_dir = Path(model_dir)
    on_disk = versions(model_dir)
    if not on_disk:
        raise ValueError(f"{str(model_dir)!r} holds no versions")
    record = read_promotion(model_dir)
    current = live_version(on_disk, record["version"])
    assert current is not None  # on_disk is not empty

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
    if isinstance(target, bool) or not isinstance(target, int) or target not in on_disk:
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
    promote(model_dir, target, "rollback", f"rolled back from version {current}")
    return {"model": model_dir.name, "promoted": target, "previous": current}


def describe(model_dir: str | Path) -> list[dict]:
    """Every version of model_dir and every kept refused candidate, oldest first: id,
    status (promoted | published | rollout | rolled-back | rejected), evaluation, lineage
    and, for a refused or rolled-back candidate, why (what ``orthornn versions`` prints).
    Reads manifests; verifies nothing."""
    from .rollout import RUNNING, read_plan, rolled_back

    model_dir = Path(model_dir)
    on_disk = versions(model_dir)
    live = live_version(on_disk, promoted(model_dir))
    try:
        plan = read_plan(model_dir)
    except ValueError:
        plan = None
    backed = rolled_back(plan)
    rolling = plan["candidate"] if plan is not None and plan["state"] == RUNNING else None
    rows = []
    for path in [*(model_dir / str(v) for v in on_disk), *rejected(model_dir)]:
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except (OSError, ValueError):
            manifest = {}
        row = {"id": path.name, "evaluation": manifest.get("evaluation"),
               "lineage": manifest.get("lineage"), "created": manifest.get("created")}
        if path.parent.name == REJECTED:
            try:
                gate = json.loads((path / "gate.json").read_text())
            except (OSError, ValueError):
                gate = {}
            row.update(status="rejected", reason=gate.get("refused"))
        else:
            version = int(path.name)
            row["status"] = "promoted" if version == live else "rollout" \
                if version == rolling else "published"
            if version in backed and version != live:  # a rollout broke a threshold
                row.update(status="rolled-back", reason=backed[version]["reason"],
                           breach=backed[version]["breach"])
        rows.append(row)
    return rows
