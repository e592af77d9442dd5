"""Errors as values: each has a code, and each code maps to one HTTP status in one table.

The ext_proc layer turns an `EppError` into an ImmediateResponse whose body is
`inference error: <Code> - <message>`, the format of the Go EPP.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    BAD_REQUEST = "BadRequest"
    NOT_FOUND = "NotFound"
    PAYLOAD_TOO_LARGE = "PayloadTooLarge"
    RESOURCE_EXHAUSTED = "ResourceExhausted"
    INTERNAL = "Internal"
    SERVICE_UNAVAILABLE = "ServiceUnavailable"


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.INTERNAL: 500,
    ErrorCode.SERVICE_UNAVAILABLE: 503,
}


class EppError(Exception):
    """A request-level failure that becomes an HTTP error response at the proxy."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def body(self) -> bytes:
        return f"inference error: {self.code.value} - {self.message}".encode()
