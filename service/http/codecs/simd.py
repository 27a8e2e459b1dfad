"""What both JSON codecs' fast paths share: simdjson's parse, refused (None: the caller
takes pydantic's path, whose messages name the field) where simdjson and pydantic would
not read a body alike."""

from __future__ import annotations

from typing import Any

import simdjson

#: what simdjson raises on malformed JSON and on a non-number where numbers are asked for
NUMBER_ERRORS = (TypeError, ValueError, RuntimeError)


def parse_object(body: bytes) -> Any | None:
    """BODY as a simdjson Object, or None: not valid JSON, not an object, or a body that
    starts with a UTF-8 BOM (simdjson skips one, pydantic refuses it). Any: the callers'
    checks are type(...) tests, which mypy does not narrow on."""
    if body.startswith(b"\xef\xbb\xbf"):
        return None
    try:
        doc = simdjson.Parser().parse(body)  # a parser per call: thread-safe, cheap
    except NUMBER_ERRORS:
        return None
    return doc if type(doc) is simdjson.Object else None
