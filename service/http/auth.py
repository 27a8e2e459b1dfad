"""Protection of the repository API: the bearer token (``ORTHORNN_ADMIN_TOKEN``; open
when no token is configured, as Triton's and MLServer's repository APIs are by default,
which the service allows on loopback only), and the checks that keep a web page open in
the user's browser from driving it (a cross-site "simple request", DNS rebinding):

- a request with an ``Origin`` header is answered only when that origin is the server
  itself (the same host and port as its ``Host``, or both on loopback with the same
  port): 403 otherwise (``Origin: null`` included);
- without a token on loopback (the default), the ``Host`` header must name loopback (``localhost``,
  ``127.0.0.1``, ``[::1]``, any port): 403 otherwise, which defeats DNS rebinding (the
  page's own host name, resolved to 127.0.0.1, arrives as the ``Host``);
- a mutating route (load, unload, rollback, rollout start/promote/abort) takes
  ``Content-Type: application/json`` only: 415 otherwise (a browser cannot send JSON
  cross-site without a CORS preflight, which the service never grants). A request that
  carries a valid token may leave the Content-Type out (tritonclient sends none; a page
  cannot send the token).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from urllib.parse import urlsplit

from pydantic import SecretStr
from starlette.types import Scope

from ..addresses import is_loopback
from ..errors import ClientError
from .responses import header

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}

#: a check for handlers: the request's ASGI scope, and whether the route mutates
AdminCheck = Callable[[Scope, bool], None]


def _host_port(netloc: str, scheme: str) -> tuple[str, int | None] | None:
    """(host name in lower case without brackets or trailing dot, port or the scheme's
    default) of a ``Host`` header or an origin's netloc; None when malformed."""
    try:
        parts = urlsplit(f"//{netloc.strip()}")
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host or parts.username is not None or parts.path or parts.query:
        return None
    return host.rstrip("."), port if port is not None else DEFAULT_PORTS.get(scheme)


def _same_server(origin: str, host: str | None, scheme: str) -> bool:
    """Whether ORIGIN (an Origin header) names the server the request came to."""
    parts = urlsplit(origin.strip())
    if parts.scheme not in DEFAULT_PORTS or host is None:
        return False
    theirs = _host_port(parts.netloc, parts.scheme)
    ours = _host_port(host, scheme)
    if theirs is None or ours is None:
        return False
    return theirs == ours or (theirs[1] == ours[1] and is_loopback(theirs[0])
                              and is_loopback(ours[0]))


def _json_content_type(scope: Scope) -> bool | None:
    """Whether the Content-Type is application/json (parameters allowed); None: absent."""
    given = header(scope, b"content-type")
    if given is None:
        return None
    return given.partition(";")[0].strip().lower() == "application/json"


def admin(token: SecretStr | None, loopback: bool, also: SecretStr | None = None,
          what: str = "the repository API") -> AdminCheck:
    """The repository API's check: raises ClientError (403 for a foreign origin or, without
    a token on a LOOPBACK listener, a non-loopback Host; 401 without ``Authorization:
    Bearer <token>``, compared in constant time; 415 for a mutating route's body that is
    not declared JSON). Without a token beyond loopback (``allow_open_repository_api``,
    open on purpose) the Host is not checked. ALSO: a second token the check takes (the
    labels route's ``labels_token``); WHAT: the routes' name in the messages."""
    tokens = [t.get_secret_value().encode() for t in (token, also) if t is not None]
    expected = tokens[0] if tokens else None
    check_host = expected is None and loopback

    def check(scope: Scope, mutating: bool) -> None:
        host = header(scope, b"host")
        scheme = scope.get("scheme", "http")
        origin = header(scope, b"origin")
        if origin is not None and not _same_server(origin, host, scheme):
            raise ClientError(f"origin {origin[:100]!r}: {what} answers no "
                              "other origin than its own (a browser page elsewhere may "
                              "not drive it)", status=403)
        if check_host and host is not None:
            found = _host_port(host, scheme)
            if found is None or not is_loopback(found[0]):
                raise ClientError(f"host {host[:100]!r}: without an admin token "
                                  f"{what} answers only requests addressed to "
                                  "loopback (localhost, 127.0.0.1, [::1])", status=403)
        if expected is not None:
            scheme_, _, given = (header(scope, b"authorization") or "").partition(" ")
            matches = [hmac.compare_digest(given.strip().encode(), t) for t in tokens]
            if scheme_.lower() != "bearer" or not any(matches):
                raise ClientError(f"authorization: a valid bearer token is required for "
                                  f"{what}", status=401)
        if mutating:
            is_json = _json_content_type(scope)
            if not is_json and not (is_json is None and expected is not None):
                raise ClientError(f"content-type: {what} takes "
                                  "application/json only (send the header, even with an "
                                  "empty body)", status=415)
    return check

