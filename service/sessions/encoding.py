"""A state vector's one byte form, float32 little-endian: the same bytes in a client's
state token (``tokens``) and in a Redis session hash (``redis``), so a state reads back bit
for bit wherever it was kept."""

from __future__ import annotations

import numpy as np


def state_bytes(state: np.ndarray) -> bytes:
    """STATE (a vector) as float32 little-endian bytes; ValueError for any other shape."""
    array = np.asarray(state)
    if array.ndim != 1:
        raise ValueError(f"a session state is a vector; got shape {array.shape}")
    return np.ascontiguousarray(array, dtype="<f4").tobytes()


def state_from_bytes(raw: bytes) -> np.ndarray:
    """The float32 vector RAW holds (a copy of its own: the caller may change it)."""
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)
