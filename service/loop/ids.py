"""A request's capture id (docs/capture.md, "Whose id"): the id the client gave, checked on
the event loop (``given_id``), and the sample decided by its hash with the request's
batch (``request_id``, ``sampled``), alike on every replica and for every retry."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

from orthornn.export.artifacts.loop.captures import REQUEST_ID_RULE, is_request_id
from orthornn.export.artifacts.rollout.plan import bucket

from ..errors import ClientError


def given_id(headers: Sequence[tuple[bytes, bytes]], oip_id: str | None = None
             ) -> bytes | str | None:
    """(Event loop.) The id the client gave the request: its first X-Request-Id header's
    bytes (400 unless 1-128 printable ASCII characters, no spaces), else the OIP
    request's ``id``, else None. Only checked here: the sample is decided with the
    request's batch (``request_id``), where a batch's requests run the same few lines one
    after another instead of each on a loop that runs the rest of the service between."""
    for key, value in headers:
        if key == b"x-request-id":
            if not is_request_id(value):
                raise ClientError(f"X-Request-Id: {REQUEST_ID_RULE}")
            return value
    return oip_id or None  # (checked by its codec: oip_json.to_inference)


def request_id(given: bytes | str | None, share: float = 1.0) -> str | None:
    """The id a request that was given GIVEN (``given_id``) is captured under at SHARE,
    None when it is not in the sample: a given id is sampled by its hash (``sampled``);
    without one, with chance SHARE, a new one. (A new id is random, so its hash falls in
    the sample with chance SHARE too: the ids of requests not kept are never made.) A
    request not in the sample costs nothing more: no record, no id in its answer."""
    if not given:
        if share < 1.0 and random.random() >= share:
            return None
        return os.urandom(16).hex()  # a fifth of uuid4's cost
    if share < 1.0 and not sampled(given, share):
        return None
    return given.decode("ascii") if isinstance(given, bytes) else given


def sampled(request: bytes | str, share: float) -> bool:
    """Whether the request with id REQUEST is captured at SHARE (0 < share <= 1): decided by
    the id's hash (the rollout's ``bucket``), so a retry and every replica decide alike."""
    return bucket(request if isinstance(request, bytes) else request.encode()) < share * 100
