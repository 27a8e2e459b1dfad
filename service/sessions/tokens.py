"""Client-held state tokens: the state of a sequence handed to the client.

A recurrent model's answer to a chunk of a sequence depends on the chunks before it only
through the hidden state after them. The service hands that state out (``return_state``)
as an opaque JSON value that names the model version that made it, and continues from it
(``states``); any replica serving that version can answer the next chunk. A state from
another model or version, of the wrong size or with non-finite numbers is refused: a
state is never applied to weights it was not made by.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np
from orthornn.export.artifacts.numbers import is_integer

from ..errors import ClientError, StateConflict
from .encoding import state_bytes, state_from_bytes


def encode_state(name: str, version: int, state: np.ndarray) -> dict:
    """The opaque state value of one sequence: {"model", "version", "data": base64 of the
    float32 little-endian state vector}."""
    data = base64.b64encode(state_bytes(state)).decode()
    return {"model": name, "version": version, "data": data}


def json_type(value: object) -> str:
    """The JSON type of a parsed value, as an error message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def check_state(value: object, where: str) -> None:
    """ClientError (400) naming the field when VALUE is not shaped like a state a response
    returned: an object with exactly model, version (an integer) and data (a string)."""
    if not isinstance(value, dict) or set(value) != {"model", "version", "data"}:
        raise ClientError(f"{where}: must be a state exactly as a response returned it "
                          f"(an object with model, version and data)")
    version = value["version"]
    if not is_integer(version):
        raise ClientError(f"{where}.version must be an integer (the version that made the "
                          f"state); got {json_type(version)}")
    if not isinstance(value["data"], str):
        raise ClientError(f"{where}.data must be a string (the base64 state an earlier answer "
                          f"returned); got {json_type(value['data'])}")


def state_version(states: list, model: str, field_name: str = "states") -> int | None:
    """The version every state of a request for MODEL names (None for no states), checked
    before any version is looked up: ClientError (400) when a state is malformed,
    StateConflict (409) when one belongs to another model (whatever versions are loaded
    here) or the states disagree on the version."""
    versions = set()
    for i, s in enumerate(states):
        where = f"{field_name}[{i}]"
        check_state(s, where)
        if s["model"] != model:
            raise StateConflict(f"{where}: a state of model {s['model']!r} (version "
                                f"{s['version']}) cannot continue on model {model!r}: a "
                                f"state only continues the model version that made it")
        versions.add(s["version"])
    if len(versions) > 1:
        raise StateConflict(f"{field_name}: the states come from different versions "
                            f"{sorted(versions)}; one request continues one version")
    return versions.pop() if versions else None


def decode_state(value: Any, name: str, version: int, size: int, where: str
                 ) -> np.ndarray:
    """A state vector [size] from an opaque state value, checked against the model version
    about to continue from it."""
    check_state(value, where)
    if value["model"] != name or value["version"] != version:
        raise StateConflict(f"{where}: a state of model {value['model']!r} version "
                            f"{value['version']!r} cannot continue on model {name!r} version "
                            f"{version}: a state only continues the version that made it")
    try:
        raw = base64.b64decode(value["data"].encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise ClientError(f"{where}.data: not valid base64") from None
    if len(raw) != 4 * size:
        raise ClientError(f"{where}.data: the state of this model has {size} numbers; "
                          f"got {len(raw) / 4:g}")
    state = state_from_bytes(raw)
    if not np.isfinite(state).all():
        raise ClientError(f"{where}.data: the state holds non-finite numbers (NaN or inf)")
    return state
