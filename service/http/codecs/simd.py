"""What both JSON codecs' fast paths share: simdjson's parse, refused (None: the caller
takes pydantic's path, whose messages name the field) where simdjson and pydantic would
not read a body alike."""

from __future__ import annotations

from typing import Any

import simdjson

from ...errors import ClientError

#: what simdjson raises on malformed JSON and on a non-number where numbers are asked for
NUMBER_ERRORS = (TypeError, ValueError, RuntimeError)


#: a body simdjson cannot parse is refused at once above this size, not handed to
#: pydantic: what simdjson refuses and pydantic's parser reads (a number beyond 64 bits)
#: would be refused anyway, and pydantic turns every value into a Python object first (1.2
#: s for 17 MB of keys)
SLOW_PATH_BYTES = 1 << 20


def parse_object(body: bytes) -> Any | None:
    """BODY as a simdjson Object, or None: not valid JSON, not an object, or a body that
    starts with a UTF-8 BOM (simdjson skips one, pydantic refuses it). Any: the callers'
    checks are type(...) tests, which mypy does not narrow on. ClientError for a body
    over SLOW_PATH_BYTES that simdjson cannot parse."""
    if body.startswith(b"\xef\xbb\xbf"):
        return None
    try:
        doc = simdjson.Parser().parse(body)  # a parser per call: thread-safe, cheap
    except NUMBER_ERRORS as error:
        if len(body) > SLOW_PATH_BYTES:
            raise ClientError(f"body is not valid JSON, or holds a number beyond 64 bits: "
                              f"{error}") from None
        return None
    return doc if type(doc) is simdjson.Object else None
