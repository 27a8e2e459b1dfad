"""Bearer-token protection of the repository API (``ORTHORNN_ADMIN_TOKEN``); open when
no token is configured, as Triton's and MLServer's repository APIs are by default."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from pydantic import SecretStr
from starlette.types import Scope

from ..errors import ClientError
from .responses import header


def bearer(token: SecretStr | None) -> Callable[[Scope], None]:
    """A check for handlers: raises ClientError(401) unless the request (its ASGI scope)
    carries ``Authorization: Bearer <token>`` (compared in constant time)."""
    expected = token.get_secret_value().encode() if token is not None else None

    def check(scope: Scope) -> None:
        if expected is None:
            return
        scheme, _, given = (header(scope, b"authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 expected):
            raise ClientError("authorization: a valid bearer token is required for the "
                              "repository API", status=401)
    return check
