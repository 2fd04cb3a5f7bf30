"""Errors of the directory and its client.

DirectoryError
├── DirectoryUnavailable      no replica answered in time (or the write's outcome is unknown)
├── CommitTimeout             a write was not committed before its deadline; retry it (idempotent)
├── MalformedAnswer           a replica answered 2xx with what the protocol does not allow (a hostile or broken replica)
└── RequestRejected           a replica answered 4xx; `status`, `error`, `detail` say why
    ├── StaleEpochError       409: the node's epoch is not current or the node expired: register again
    │   └── WrongShardError   409: the node belongs to another shard (the client rereads the shard map)
    ├── NotFoundError         404
    ├── InvalidRequestError   400, 413, 415, 422
    ├── AuthError             401 (no or unknown bearer token), 403 (the token may not do this)
    └── LimitError            429, 507: a configured limit (nodes, entries) is reached
"""

from __future__ import annotations


class DirectoryError(Exception):
    """Base of every error raised by kvdir's directory and its client."""


class DirectoryUnavailable(DirectoryError):
    pass


class CommitTimeout(DirectoryError):
    pass


class MalformedAnswer(DirectoryError):
    pass


class RequestRejected(DirectoryError):
    def __init__(self, status: int, error: str, detail: object = None) -> None:
        super().__init__(f"{status} {error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail


class StaleEpochError(RequestRejected):
    pass


class WrongShardError(StaleEpochError):
    """The node's home is another shard: a 409 like an expiry (the session registers again), and a sign
    that the client's shard map is out of date."""


class NotFoundError(RequestRejected):
    pass


class InvalidRequestError(RequestRejected):
    pass


class LimitError(RequestRejected):
    pass


class AuthError(RequestRejected):
    pass


def rejection(status: int, error: str, detail: object = None) -> RequestRejected:
    """The RequestRejected subclass for an HTTP status (and error code, where one status has several meanings)."""
    if error == "wrong_shard":
        return WrongShardError(status, error, detail)
    if error == "stale_map":
        return RequestRejected(status, error, detail)
    cls = {409: StaleEpochError, 404: NotFoundError, 429: LimitError, 507: LimitError, 401: AuthError, 403: AuthError}.get(status)
    if cls is None:
        cls = InvalidRequestError if status in (400, 413, 415, 422) else RequestRejected
    return cls(status, error, detail)
