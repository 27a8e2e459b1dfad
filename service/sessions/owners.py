"""Who a session belongs to: whoever started it. The answer to a session's start carries a
secret (one the service draws, 192 bits, or one the client chose and sent with its start,
so that a retried start whose answer was lost is recognised); every later chunk presents
it (``session_secret`` in the body or the inference request's parameters, or the
``Orthornn-Session-Secret`` header). The store keeps only its SHA-256; the comparison is in
constant time. A chunk without the right secret is answered as for an id never started
(404: the answer does not confirm that the id exists); a start on an id open for someone
else gets 409, never a reset. The ``session_secrets`` setting off (a trusted network), no
secret is issued or checked.

Session ids are bounded here, one limit for both protocols (``MAX_ID_LENGTH``), before a
store keeps one."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from ..errors import ClientError

#: the longest session id (characters), /predict's ``session`` and OIP's ``sequence_id``
MAX_ID_LENGTH = 128
#: the longest secret a client may present (a longer one is refused before it is hashed)
MAX_SECRET_LENGTH = 128
#: a secret a client chooses for its start: 22 to 128 characters of base64, base64url or
#: hex that can carry 128 bits (22 base64 characters, 32 hex digits; draw them at random,
#: e.g. ``openssl rand -hex 16`` or ``secrets.token_urlsafe(24)``)
CHOSEN = re.compile(r"[A-Za-z0-9._~+/=-]{22,128}")
_HEX = re.compile(r"[0-9a-fA-F]+")
#: the fewest different characters a chosen secret holds: a random one has fewer with a
#: chance below 1e-12 (22 base64 characters: 3e-13 under 8; 32 hex digits: 3e-13 under 6),
#: while "aaaa...", "0000..." or "...." (guessed at once) have one
MIN_DISTINCT = 6


def check_id(sid: str, field: str) -> None:
    """ClientError (400) naming FIELD unless SID has 1 to MAX_ID_LENGTH characters."""
    if not 1 <= len(sid) <= MAX_ID_LENGTH:
        raise ClientError(f"{field}: 1 to {MAX_ID_LENGTH} characters; got {len(sid)}")


def check_secret(secret: str | None, field: str) -> None:
    """ClientError (400) naming FIELD when a presented SECRET is longer than any secret."""
    if secret is not None and len(secret) > MAX_SECRET_LENGTH:
        raise ClientError(f"{field}: at most {MAX_SECRET_LENGTH} characters; got "
                          f"{len(secret)}")


def new_secret() -> str:
    """A secret nobody can guess: 192 random bits, base64url (32 characters)."""
    return secrets.token_urlsafe(24)


def chosen(secret: str, field: str) -> str:
    """SECRET, a client's choice for its start, when it can hold 128 random bits (else
    400): its form, its length for its alphabet (hex carries 4 bits a character, base64 6)
    and at least MIN_DISTINCT different characters."""
    bits = len(secret) * (4 if _HEX.fullmatch(secret) else 6)
    if not CHOSEN.fullmatch(secret) or bits < 128 or len(set(secret)) < MIN_DISTINCT:
        raise ClientError(f"{field}: a secret chosen for a start must be 22 to 128 "
                          f"characters of base64 (32 of hex), drawn at random (at least 128 "
                          f"random bits: {MIN_DISTINCT} or more different characters); or "
                          f"leave it out and the answer gives one")
    return secret


def digest(secret: str | None) -> str | None:
    """What the store keeps of SECRET: its SHA-256 (hex); None for None."""
    if secret is None:
        return None
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def matches(kept: str | None, presented: str | None) -> bool:
    """Whether PRESENTED (a digest) is the KEPT one, compared in constant time; a session
    kept without a secret matches no secret."""
    if kept is None or presented is None:
        return False
    return hmac.compare_digest(kept.encode(), presented.encode())
