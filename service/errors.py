"""Every error the service answers with, in one place. Each carries the HTTP status (and
headers) it is answered with, as MLServer's errors do, so one handler
(``http.responses.error_response``) maps every one of them to ``{"error": message}``
without a table of types. Anything else is a logged 500. A leaf: it imports nothing of
the service."""

from __future__ import annotations

#: the response header naming a session's position after a chunk (the answer of a
#: chunk, and of a PositionConflict); ``orthornn predict --stream`` reads it
POSITION_HEADER = "Orthornn-Session-Position"
#: the header carrying a session's secret: the answer to its start gives it, every later
#: chunk presents it (``session_secret`` in a /predict body or an inference request's
#: parameters does the same)
SECRET_HEADER = "Orthornn-Session-Secret"


class ServiceError(Exception):
    """An answer to the client: ``status``, ``headers`` and {"error": message}."""

    status = 500
    headers: dict[str, str] | None = None

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class ClientError(ServiceError):
    """A request the client must fix (400 unless it says otherwise)."""

    status = 400


class NotFound(ServiceError, LookupError):
    """An unknown model, version or session."""

    status = 404


class UnknownSession(NotFound):
    """A session that is not open (404)."""


class Conflict(ClientError):
    """A request that contradicts the state of the service: a state or session of
    another model version, a rollback it cannot do."""

    status = 409


class StateConflict(Conflict):
    """A state or session of another model version (409)."""


class SessionExists(Conflict):
    """A session id that is already open (409)."""


class PositionConflict(Conflict):
    """A chunk for a position the session is no longer at (409): another request applied
    a chunk first, or the client's view is stale. ``position`` is the session's current
    position (time steps consumed), also in the POSITION_HEADER of the answer."""

    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = position
        self.headers = {POSITION_HEADER: str(position)}


class RollbackRefused(Conflict):
    """A rollback that cannot be done (409); the message names the usable versions."""


class VersionGone(Conflict):
    """A session's pinned version that this replica cannot load: gone from the repository,
    no longer verifying, or its model unloaded (409 naming the version)."""


class BodyTooLarge(ServiceError):
    status = 413

    def __init__(self, limit: int):
        super().__init__(f"body: larger than the limit of {limit} bytes (max_body_bytes)")


class Overloaded(ServiceError):
    """Come back in a second: a full queue, or too many open sessions."""

    status = 429
    headers = {"Retry-After": "1"}  # noqa: RUF012 (read only)


class QueueFull(Overloaded):
    """Too many sequences waiting for one model version (429)."""


class SessionLimit(Overloaded):
    """Too many open sessions (429)."""


class OutputsFull(ServiceError):
    """The answers being made or sent hold max_output_bytes_in_flight: come back in a
    second (503, the deployment's load: a rollout never counts it)."""

    status = 503
    headers = {"Retry-After": "1"}  # noqa: RUF012 (read only)


class StoreUnavailable(ServiceError):
    """A store (the session store's shared Redis, the capture bucket) did not answer in
    time or failed: come back in a second (503)."""

    status = 503
    headers = {"Retry-After": "1"}  # noqa: RUF012 (read only)
