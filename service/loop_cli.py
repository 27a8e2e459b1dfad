"""``orthornn labels import`` (labels in bulk, ``service.loop.labels``) and ``orthornn capture
dataset`` (a training set from the labelled captures, ``export.artifacts.loop.dataset``): the loop's
commands. Torch-free; the command package hands in its one ``--no-progress`` definition
(``training.flags``, which service/ does not import)."""

from __future__ import annotations

import argparse
import csv
import io
from collections.abc import Callable
from pathlib import Path

MAX_IMPORT_BYTES = 256 << 20  # an import file's size (its labels are held while checked: about
# 5 million labels, a few GiB as Python objects at most)


def add_loop_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                     add_progress_flag: Callable[[argparse.ArgumentParser], None]) -> None:
    labels = sub.add_parser("labels", help="labels of captured requests (import in bulk)",
                            description="Labels of captured requests, as POST "
                                        "/v2/models/NAME/labels takes them, from a file.")
    actions = labels.add_subparsers(dest="action", metavar="ACTION", required=True)
    imp = actions.add_parser(
        "import", help="labels from a JSON-lines or CSV file (id,label)",
        description="Checks every label (a captured id of NAME, not labelled yet, a class "
                    "of the version that answered it, or next tokens in its vocabulary), "
                    "then appends them all (source \"import\") beside the captures, "
                    "DIR/NAME/labels/<day>/. All or nothing: one bad line, exit 2 naming "
                    "it, and nothing is written.")
    imp.add_argument("file", metavar="FILE",
                     help='JSON lines ({"id": ..., "label": ...} per line) or CSV with the '
                          "columns id,label (a header row optional); a CSV label is a class "
                          "index or name, text (a language model's next words) or JSON (a "
                          "list)")
    imp.add_argument("--capture", metavar="DIR", required=True,
                     help="the capture folder (orthornn serve --capture DIR)")
    imp.add_argument("--name", required=True, help="the model's name")
    imp.add_argument("--repo", metavar="REPO", required=True,
                     help="the model repository (the manifest of the version that answered "
                          "each id)")
    imp.set_defaults(run=run_import)

    capture = sub.add_parser("capture", help="the captured requests (a training set from "
                                             "the labelled ones)")
    actions = capture.add_subparsers(dest="action", metavar="ACTION", required=True)
    data = actions.add_parser(
        "dataset", help="labelled captures -> an .npz for orthornn train --task classify "
                        "--data, or a text corpus for --task lm --corpus",
        description="Joins the labels to the captured records by id (a label later than "
                    "--window days after its record is not used; an id captured twice is "
                    "kept once), splits by time (the newest --holdout-share of the "
                    "labelled records is held out) and writes FILE and FILE2 in the format "
                    "orthornn train --task classify --data reads, with the provenance "
                    "arrays ids, times, segments and versions; a language model's as the "
                    "text corpus --task lm --corpus reads (a line per sequence: its input "
                    "tokens, then its labelled next tokens, as words of the vocabulary of "
                    "the version that answered; needs --repo), the provenance in FILE.json.")
    data.add_argument("--capture", metavar="DIR", required=True, help="the capture folder")
    data.add_argument("--name", required=True, help="the model's name")
    data.add_argument("--since", metavar="DATE",
                      help="only the captures of this UTC day (YYYY-MM-DD) and later")
    data.add_argument("--window", metavar="DAYS", default="7",
                      help="a label counts when it came at most DAYS after its record "
                           "(default 7)")
    data.add_argument("--holdout-share", metavar="F", default="0.2",
                      help="the newest share of the labelled records held out (0 <= F < 1, "
                           "default 0.2; 0: no FILE2)")
    data.add_argument("--out", metavar="FILE", required=True,
                      help="the training part (.npz; a language model's: a text corpus)")
    data.add_argument("--holdout", metavar="FILE2",
                      help="the held-out part (default: <FILE stem>-holdout.npz beside FILE; "
                           "a language model's: <FILE stem>-holdout<FILE's suffix or .txt>)")
    data.add_argument("--repo", metavar="REPO",
                      help="the model repository: the class names (or a language model's "
                           "vocabulary, required then) from the manifests of the versions "
                           "that answered (default: as the records' answers name them)")
    add_progress_flag(data)
    data.set_defaults(run=run_dataset)


def _number(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag}: a number; got {text!r}") from None


def run_dataset(args: argparse.Namespace) -> int:
    from orthornn.export.artifacts.loop.dataset import holdout_path, write_dataset

    share = _number("--holdout-share", args.holdout_share)
    summary = write_dataset(Path(args.capture), args.name, Path(args.out),
                            None if args.holdout is None else Path(args.holdout),
                            since=args.since, window_days=_number("--window", args.window),
                            holdout_share=share,
                            repo=None if args.repo is None else Path(args.repo),
                            progress=not args.no_progress)
    for line in summary.lines():
        print(f"{args.name}: {line}")
    held = "" if share == 0 else \
        f", {args.holdout or holdout_path(Path(args.out), summary.task)} ({summary.holdout})"
    print(f"wrote {args.out} ({summary.train}){held}")
    return 0


def _csv_label(text: str) -> object:
    """A CSV cell: JSON (an index, a list) when it parses as such, else the text (a class
    name, or a language model's next words)."""
    import orjson

    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text
    return value if isinstance(value, int | list) and not isinstance(value, bool) else text


def read_label_file(path: Path) -> tuple[list[dict], list[int]]:
    """The labels of FILE ([{"id", "label"}]) and each one's line number; ValueError naming
    the line and the field."""
    import orjson

    if not path.is_file():
        raise ValueError(f"FILE: {str(path)!r} is not a file")
    if path.stat().st_size > MAX_IMPORT_BYTES:
        raise ValueError(f"FILE: {str(path)!r} is larger than {MAX_IMPORT_BYTES >> 20} MiB; "
                         f"split it")
    # utf-8-sig: a byte-order mark (spreadsheets write one) is not part of the first id,
    # and does not hide a JSON-lines file's first "{"
    text = path.read_text(encoding="utf-8-sig", errors="replace")
    first = next((line for line in text.splitlines() if line.strip()), "")
    items, numbers = [], []
    if first.lstrip().startswith("{"):  # JSON lines
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                value = orjson.loads(line)
            except orjson.JSONDecodeError as error:
                raise ValueError(f"{path} line {n}: not JSON ({error})") from None
            if not isinstance(value, dict):
                raise ValueError(f'{path} line {n}: an object {{"id": ..., "label": ...}}')
            items.append(value)
            numbers.append(n)
        return items, numbers
    # strict: an unbalanced quote is an error at its line, not the rest of the file read
    # as one field; the line numbers are the file's (a quoted field may hold newlines)
    reader = csv.reader(io.StringIO(text), strict=True)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return items, numbers
        except csv.Error as error:  # e.g. a field over csv's limit of 128 KiB, a stray quote
            raise ValueError(f"{path} line {reader.line_num}: not CSV ({error})") from None
        n = reader.line_num
        if not row or not "".join(row).strip():
            continue
        if not items and [c.strip().lower() for c in row] == ["id", "label"]:
            continue  # the header
        if len(row) != 2:
            raise ValueError(f"{path} line {n}: two columns id,label; got {len(row)}")
        items.append({"id": row[0].strip(), "label": _csv_label(row[1].strip())})
        numbers.append(n)


def run_import(args: argparse.Namespace) -> int:
    from .errors import ServiceError
    from .loop.labels import LabelError, LabelStore

    path = Path(args.file)
    items, numbers = read_label_file(path)
    if not items:
        raise ValueError(f"FILE: {str(path)!r} holds no labels")
    store = LabelStore(Path(args.capture), Path(args.repo), source="import")
    try:
        count = store.add(args.name, items, limit=None)
    except LabelError as error:
        where = f"{path} line {numbers[error.index]}" if error.index is not None else str(path)
        field = f"{error.field}: " if error.field else ""
        raise ValueError(f"{where}: {field}{error.reason} (nothing was imported)") from None
    except ServiceError as error:  # the store's other client errors (an unknown model)
        raise ValueError(f"{error} (nothing was imported)") from None
    print(f"{args.name}: imported {count} labels from {path} into {args.capture}")
    return 0
