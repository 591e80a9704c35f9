"""What a service refuses, in words a router translates: a missing resource, an invalid request, a
conflict with the current state. Each carries a machine-readable ``code``, the request field it
names (``param``) and a message; ``server/errors.py`` gives each its HTTP status, once."""

from __future__ import annotations

from typing import Any


class Refusal(Exception):
    """A request a service will not carry out; ``details`` and ``extra``: more about it (an
    invalid upload's rows, their count)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        details: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.details, self.extra = code, message, param, details, extra


class NotFound(Refusal):
    """No such base model, dataset, job or checkpoint."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__("not_found", message, param=param)


class Invalid(Refusal):
    """A request that names what exists but cannot be carried out (a bad config, a bad file)."""


class Conflict(Refusal):
    """A request the current state does not allow yet (e.g. a job with nothing measured)."""


class TooLarge(Refusal):
    """More bytes than the limit allows (an upload)."""
