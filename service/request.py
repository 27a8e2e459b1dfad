"""The request being answered, as every layer below the HTTP layer sees it: one ``Scope``
per request in a context variable (as MLServer's ``context.py``), opened by the dispatcher
(``http.routing``) and written where a model version is leased for it, so that the request
is counted under the version that answered, a failed one too (docs/design.md, "The path of
one request")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(slots=True)
class Scope:
    # capture (service.loop.capture): the id the client gave (checked on the event loop),
    # whether the sample is still to be decided, the route it is recorded under, and the
    # id its record is kept under once it is decided in the sample
    given: bytes | str | None = None
    deciding: bool = False
    route: str | None = None
    id: str | None = None
    model: str | None = None  # the version leased for the request (the catalog, sessions)
    version: int | None = None
    named: str | None = None  # the model (and version) it named (its handler)
    named_version: int | None = None
    # a rollout counts only the requests it placed: the routing key of a request whose
    # version the service chose (none named, no states; a session's id), its compute time
    # (queue and inference), and whether the candidate refused (4xx) an input the
    # promoted version takes (the candidate's failure, not the client's)
    route_key: bytes | None = None
    compute_s: float | None = None
    candidate_refused: bool = False
    # the per-step output bytes the request holds of max_output_bytes_in_flight, given
    # back (give_back) once its answer is built (service.dataplane.in_flight)
    output_bytes: int = 0
    give_back: Callable[[Scope], None] | None = None


_current: ContextVar[Scope | None] = ContextVar("orthornn_request", default=None)


@contextmanager
def opened() -> Iterator[Scope]:
    """A new request's scope, current until the block ends."""
    scope = Scope()
    token = _current.set(scope)
    try:
        yield scope
    finally:
        _current.reset(token)
        answered(scope)


def current() -> Scope:
    """The scope of the request being answered (outside one, a scope nobody reads)."""
    scope = _current.get()
    return scope if scope is not None else Scope()


def answered(scope: Scope) -> None:
    """SCOPE's answer is built (encoded, or an error): what it holds is given back (once).
    Its bytes waiting to be sent are the connection's: a client that does not read cannot
    hold what other requests need."""
    if scope.give_back is not None:
        give_back, scope.give_back = scope.give_back, None
        give_back(scope)
