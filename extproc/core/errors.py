"""Errors as values: each has a code, and each code maps to one HTTP status in one table.

The ext_proc layer turns an `EppError` into an ImmediateResponse with an OpenAI-compatible JSON
body, the shape vLLM and the OpenAI API return, so SDKs show the message:

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}

`type` is `<Code>Error` (`BadRequestError`, `RateLimitError` for 429, ...), `code` the HTTP status
(as vLLM), and the content type is `application/json`. A 500 (an unexpected fault in the picker)
carries the request id in its message so an operator can find the one log line that explains it.
"""

from __future__ import annotations

import enum

import orjson


class ErrorCode(enum.Enum):
    BAD_REQUEST = "BadRequest"
    NOT_FOUND = "NotFound"
    REQUEST_TIMEOUT = "RequestTimeout"
    PAYLOAD_TOO_LARGE = "PayloadTooLarge"
    RESOURCE_EXHAUSTED = "ResourceExhausted"
    INTERNAL = "Internal"
    SERVICE_UNAVAILABLE = "ServiceUnavailable"


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.INTERNAL: 500,
    ErrorCode.SERVICE_UNAVAILABLE: 503,
}

# The `type` field, named as the OpenAI SDK names its exception classes.
ERROR_TYPE: dict[ErrorCode, str] = {
    ErrorCode.BAD_REQUEST: "BadRequestError",
    ErrorCode.NOT_FOUND: "NotFoundError",
    ErrorCode.REQUEST_TIMEOUT: "RequestTimeoutError",
    ErrorCode.PAYLOAD_TOO_LARGE: "PayloadTooLargeError",
    ErrorCode.RESOURCE_EXHAUSTED: "RateLimitError",
    ErrorCode.INTERNAL: "InternalServerError",
    ErrorCode.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}

CONTENT_TYPE = "application/json"


class EppError(Exception):
    """A request-level failure that becomes an HTTP error response at the proxy.

    `retry_after_s`, when set, becomes a `Retry-After` header (429 under memory pressure);
    `dropped_reason`, when set, the `x-llm-d-request-dropped-reason` header (flow control's
    outcomes, extproc/flowcontrol/outcomes.py).
    """

    def __init__(self, code: ErrorCode, message: str, retry_after_s: int | None = None,
                 dropped_reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.dropped_reason = dropped_reason

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": ERROR_TYPE[self.code], "param": None,
                                       "code": self.http_status}})
