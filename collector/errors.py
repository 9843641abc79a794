"""Why a request was refused, and what each transport answers: the one place where
outcomes map to HTTP and gRPC codes (OTLP spec, "Failures").

Only overload is retryable (HTTP 503 + Retry-After, gRPC UNAVAILABLE + RetryInfo;
a client over its own limits: HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED +
RetryInfo); everything else tells the client not to resend the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


class Refused(Exception):
    """Base: the request was not acknowledged. `reason` labels the metric."""

    reason = "refused"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(Refused):
    """Not retryable. `violations`, (field, why) pairs, become a `google.rpc.BadRequest`
    detail so a client can show every problem, not only the first."""

    reason = "bad_request"

    def __init__(self, message: str, violations: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.violations = violations or []


class TooLarge(Refused):
    reason = "too_large"


class UnsupportedMediaType(Refused):
    reason = "unsupported_media_type"


class Unauthenticated(Refused):
    reason = "unauthenticated"


class NotFound(Refused):
    reason = "not_found"


class RequestTimeout(Refused):
    """The client stopped sending in the middle of its request body."""

    reason = "timeout"


class Overloaded(Refused):
    """Retryable: the WAL is over its cap, the disk refused a write, or too many
    requests are in flight. Clients back off `retry_after` seconds and resend."""

    reason = "overloaded"

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class Throttled(Overloaded):
    """Retryable: this client is over its own share (`fairness`); others are not
    affected. RESOURCE_EXHAUSTED is retryable only with RetryInfo, which it carries."""

    reason = "throttled"


@dataclass(frozen=True)
class WireStatus:
    http: int
    grpc_name: str  # a grpc.StatusCode's name: gRPC is imported when asked, so the flusher, which reads the log, needs none

    @property
    def grpc(self):
        import grpc

        return grpc.StatusCode[self.grpc_name]


_STATUS = {
    BadRequest: WireStatus(400, "INVALID_ARGUMENT"),
    TooLarge: WireStatus(413, "RESOURCE_EXHAUSTED"),
    UnsupportedMediaType: WireStatus(415, "INVALID_ARGUMENT"),
    Unauthenticated: WireStatus(401, "UNAUTHENTICATED"),
    NotFound: WireStatus(404, "UNIMPLEMENTED"),
    RequestTimeout: WireStatus(408, "DEADLINE_EXCEEDED"),
    Overloaded: WireStatus(503, "UNAVAILABLE"),
    Throttled: WireStatus(429, "RESOURCE_EXHAUSTED"),
}


def wire_status(error: Refused) -> WireStatus:
    for cls in type(error).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return WireStatus(500, "INTERNAL")
