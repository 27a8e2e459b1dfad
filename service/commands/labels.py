"""``orthornn labels import``: labels in bulk from a JSON-lines or CSV file, through the
store the labels route uses (``service.loop.labels``: the same checks, all or nothing).
Torch-free, and without the serving stack (no FastAPI, pydantic or prometheus_client)."""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path

MAX_IMPORT_BYTES = 256 << 20  # an import file's size (its labels are held while checked: about
# 5 million labels, a few GiB as Python objects at most)


def add_labels_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
                     help="the capture folder or bucket (orthornn serve --capture DIR or "
                          "s3://BUCKET/PREFIX: the labels become one object there)")
    imp.add_argument("--name", required=True, help="the model's name")
    imp.add_argument("--repo", metavar="REPO", required=True,
                     help="the model repository (the manifest of the version that answered "
                          "each id)")
    imp.set_defaults(run=run_import)


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
    from orthornn.export.artifacts.repository import check_name, local_repo

    from ..errors import ServiceError
    from ..loop.labels import LabelError, LabelStore

    path = Path(args.file)
    items, numbers = read_label_file(path)
    if not items:
        raise ValueError(f"FILE: {str(path)!r} holds no labels")
    try:
        with local_repo(args.repo, check_name(args.name)) as repo:  # a bucket's: mirrored
            count = LabelStore(args.capture, repo, source="import").add(args.name, items,
                                                                        limit=None)
    except LabelError as error:
        where = f"{path} line {numbers[error.index]}" if error.index is not None else str(path)
        field = f"{error.field}: " if error.field else ""
        raise ValueError(f"{where}: {field}{error.reason} (nothing was imported)") from None
    except ServiceError as error:  # the store's other client errors (an unknown model)
        raise ValueError(f"{error} (nothing was imported)") from None
    print(f"{args.name}: imported {count} labels from {path} into {args.capture}")
    return 0
