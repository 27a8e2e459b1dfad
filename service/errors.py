"""The service's errors: each carries the HTTP status (and headers) it is answered with,
as MLServer's errors do, so one handler (``http.answer``) maps every one of them to
``{"error": message}`` without a table of types. Anything else is a logged 500."""

from __future__ import annotations


class ServiceError(Exception):
    """An answer to the client: ``status``, ``headers`` and {"error": message}."""

    status = 500
    headers: dict[str, str] | None = None
    #: the model version a request held when this was raised (name, version), if any: the
    #: HTTP layer counts the request under it
    served: tuple[str, int] | None = None

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


class Conflict(ClientError):
    """A request that contradicts the state of the service: a state or session of
    another model version, a rollback it cannot do."""

    status = 409


class BodyTooLarge(ServiceError):
    status = 413

    def __init__(self, limit: int):
        super().__init__(f"body: larger than the limit of {limit} bytes")


class Overloaded(ServiceError):
    """Come back in a second: a full queue, or too many open sessions."""

    status = 429
    headers = {"Retry-After": "1"}  # noqa: RUF012 (read only)


class StoreUnavailable(ServiceError):
    """The session store (a shared Redis) did not answer in time or failed: come back in a
    second (503)."""

    status = 503
    headers = {"Retry-After": "1"}  # noqa: RUF012 (read only)
