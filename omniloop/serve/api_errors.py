"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the HTTP API reports goes through ``ApiError`` so clients (the openai SDK included)
always see the same shape; ``code`` is the HTTP status, as vLLM does.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

# OpenAI's error ``type`` per status; the SDK maps statuses to exception classes on its own.
_TYPE_OF_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "request_aborted",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A request failure that becomes a JSON error body with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return error_type(self.status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_type(status: int) -> str:
    return _TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def reason_label(status: int) -> str:
    """A short, bounded label for the ``errors_total`` metric (never the free-text message)."""
    return {
        400: "bad_request",
        401: "unauthorized",
        404: "not_found",
        413: "too_large",
        422: "unprocessable",
        429: "overloaded",
        503: "unavailable",
    }.get(status, "server_error" if status >= 500 else f"http_{status}")
