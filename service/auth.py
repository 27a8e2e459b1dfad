"""Bearer-token protection of the repository API (``ORTHORNN_ADMIN_TOKEN``); open when
no token is configured, as Triton's and MLServer's repository APIs are by default."""

from __future__ import annotations

import hmac

from fastapi import Request
from pydantic import SecretStr

from .inputs import ClientError


def bearer(token: SecretStr | None):
    """A check for handlers: raises ClientError(401) unless the request carries
    ``Authorization: Bearer <token>`` (compared in constant time)."""
    expected = token.get_secret_value().encode() if token is not None else None

    def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 expected):
            raise ClientError("authorization: a valid bearer token is required for the "
                              "repository API", status=401)
    return check
