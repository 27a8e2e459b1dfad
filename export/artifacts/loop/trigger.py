"""Whether the retraining job runs now (``orthornn retrain-trigger``, docs/retraining.md):
it fires when drift is detected on the captures or when enough labels arrived since the
promoted version was published, and never within the cooldown of the last version
published or candidate refused by the gate; with no version yet it fires (reason
"first"). Torch-free; the command (``service.commands.trigger``) reads the flags, runs
``orthornn monitor`` as the drift check and prints the decision."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..repository import live_version, promoted, rejected, versions
from .captures import read_labels

#: a drift check: (orthornn monitor's exit status: 1 drift, 0 none, 2 could not tell;
#: its last line of output)
DriftCheck = Callable[[], tuple[int, str]]


@dataclass(frozen=True)
class Decision:
    fire: bool
    reason: str  # drift | labels | first, or none when it does not fire
    message: str  # the one line printed


def _created(path: Path) -> float | None:
    """A version's (or a refused candidate's) creation time from its manifest, as Unix
    seconds; None when it has none (an unreadable or very old manifest)."""
    import json

    try:
        text = json.loads((path / "manifest.json").read_text()).get("created")
        return dt.datetime.fromisoformat(text).timestamp() if isinstance(text, str) else None
    except (OSError, ValueError, AttributeError):
        return None


def _when(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="seconds")


def count_labels(capture: Path, name: str, since: float | None) -> int:
    """Labels of NAME under the capture folder that arrived after ``since`` (Unix seconds;
    every label when None)."""
    return sum(1 for label in read_labels(capture, name)
               if since is None or (isinstance(label.get("time"), int | float)
                                    and label["time"] > since))


def decide(capture: Path, model_dir: Path, *, min_labels: int, cooldown_hours: float,
           drift: bool, drift_check: DriftCheck, now: float | None = None) -> Decision:
    """Whether the retraining job runs, and why (the rules of the module docstring), in
    the order: no version yet, the cooldown, drift, labels."""
    now = time.time() if now is None else now
    name = model_dir.name
    on_disk = versions(model_dir)
    if not on_disk:  # nothing serves yet, so nothing was captured: a first version
        return Decision(True, "first", f"fires: no version of {name} is published yet "
                                       f"(reason first: train on the original data)")
    if not capture.is_dir():
        raise ValueError(f"--capture {str(capture)!r} is not a folder (the capture folder of "
                         f"orthornn serve --capture)")
    attempts = [(t, f"version {p.name} was published") for p in
                (model_dir / str(v) for v in on_disk) if (t := _created(p)) is not None]
    attempts += [(t, f"candidate {p.name} was refused by the gate") for p in
                 rejected(model_dir) if (t := _created(p)) is not None]
    if attempts:
        last, what = max(attempts)
        if now - last < cooldown_hours * 3600:
            return Decision(False, "none", f"nothing to do: {what} {(now - last) / 3600:.1f} h "
                            f"ago, within the --cooldown of {cooldown_hours:g} h (until "
                            f"{_when(last + cooldown_hours * 3600)})")
    live = live_version(on_disk, promoted(model_dir))
    since = _created(model_dir / str(live))
    drift_note = "drift off (--no-drift)"
    if drift:
        code, detail = drift_check()
        if code == 1:
            return Decision(True, "drift", f"fires: drift detected on the captures of {name} "
                                           f"(orthornn monitor: {detail})")
        drift_note = "no drift" if code == 0 else \
            f"drift not measured (orthornn monitor exit {code}: {detail})"
    labels = count_labels(capture, name, since)
    since_text = f"since promoted version {live} was published" + (
        f" ({_when(since)})" if since is not None else " (its time unknown: every label)")
    if labels >= min_labels:
        return Decision(True, "labels", f"fires: {labels} labels arrived {since_text}, at "
                                        f"least --min-labels {min_labels}; {drift_note}")
    return Decision(False, "none", f"nothing to do: {drift_note}; {labels} labels "
                                   f"{since_text}, fewer than --min-labels {min_labels}")
