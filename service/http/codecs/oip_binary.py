"""The Open Inference Protocol's binary tensor data extension: a JSON header of
``Inference-Header-Content-Length`` bytes (``codecs.oip_json``), then the raw tensors of
the inputs whose ``parameters.binary_data_size`` says so, in order; answers the same way
for the outputs that ask for ``binary_data``."""

from __future__ import annotations

import orjson
from orthornn.export.artifacts.numbers import is_integer

from ...dataplane.messages import Inference, InferenceResult
from ...dataplane.schemas import InferenceRequest
from ...errors import ClientError
from . import oip_json

HEADER_LENGTH = "Inference-Header-Content-Length"


def decode(body: bytes, header_length: str | None, name: str, version: str | None
           ) -> Inference:
    """A request whose JSON header is the first HEADER_LENGTH bytes of BODY (None: all of
    it, a plain JSON request)."""
    if header_length is None:
        return oip_json.decode(body, name, version)
    # ASCII digits only: str.isdigit() also takes '²' (a header byte 0xb2), which int()
    # refuses (a 500 found by tests/fuzz); 19 digits bound int()'s work
    if not (header_length.isascii() and header_length.isdigit()
            and len(header_length) <= 19) or int(header_length) > len(body):
        raise ClientError(f"{HEADER_LENGTH}: must be an integer no larger than the body")
    head, tail = body[:int(header_length)], body[int(header_length):]
    req, arrays = oip_json.parse_header(head)
    return oip_json.to_inference(req, arrays, binary_chunks(req, tail), name, version)


def encode(inference: Inference, result: InferenceResult) -> tuple[bytes, list[bytes]]:
    """The JSON header and the binary outputs' blobs (none when no output asked for
    binary data: then the header is the whole JSON answer)."""
    answer, blobs = oip_json.document(result, inference.binary_outputs())
    return orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY), blobs


def binary_chunks(req: InferenceRequest, tail: bytes) -> dict[str, bytes]:
    """The binary tensor data extension: inputs with parameters.binary_data_size take
    consecutive chunks of the bytes after the JSON header."""
    chunks, offset = {}, 0
    for inp in req.inputs:
        size = (inp.parameters or {}).get("binary_data_size")
        if size is None:
            continue
        if not is_integer(size) or size < 0:
            raise ClientError(f"inputs[{inp.name}].parameters.binary_data_size: must be a "
                              f"non-negative integer")
        if offset + size > len(tail):
            raise ClientError(f"inputs[{inp.name}].parameters.binary_data_size: {size} bytes "
                              f"past the end of the body")
        chunks[inp.name] = tail[offset:offset + size]
        offset += size
    if offset != len(tail):
        raise ClientError(f"body: {len(tail) - offset} bytes of binary data belong to no input")
    return chunks
