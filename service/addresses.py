"""The checks of the service's network addresses, below the settings (a leaf): the session
store's Redis URL (checked, and redacted for logs), and whether a host is loopback."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import SplitResult, urlsplit

STORE_FORMS = ('"memory" or "redis://[:PASSWORD@]HOST[:PORT][/DB]" ("rediss://" for TLS; '
               'percent-encode / ? # @ % in the password)')


def check_store_url(value: str) -> SplitResult | None:
    """The parsed redis:// or rediss:// URL of a ``session_store`` value (None for
    "memory"); ValueError naming the field and the allowed forms otherwise. The message
    never repeats a password."""
    if value == "memory":
        return None

    def bad(why: str) -> ValueError:
        return ValueError(f"session_store: {why}; allowed: {STORE_FORMS}")

    try:
        parts = urlsplit(value)
    except ValueError:
        raise bad("not a URL") from None
    if parts.scheme not in ("redis", "rediss"):
        shown = redact(value) if "://" in value else value
        raise bad(f"{shown!r} is neither memory nor a Redis URL")
    if not parts.hostname:
        raise bad("the Redis URL names no host")
    try:
        port = parts.port
    except ValueError:
        raise bad("the port must be a number from 1 to 65535") from None
    if port == 0:
        raise bad("the port must be a number from 1 to 65535")
    if parts.path not in ("", "/") and not re.fullmatch(r"/[0-9]{1,5}", parts.path):
        raise bad(f"the database {parts.path[1:]!r} must be a number (/0 by default)")
    if parts.query or parts.fragment:
        raise bad("the Redis URL takes no ?query or #fragment (the timeouts are "
                  "session_store_timeout_s)")
    return parts


def redact(url: str) -> str:
    """URL without its password (for logs and messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def is_loopback(host: str) -> bool:
    """Whether HOST (an address or "localhost") is reachable from this machine only."""
    if host.strip().lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # another host name: it may resolve beyond loopback
        return False
