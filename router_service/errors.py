"""Errors the service answers with: JSON bodies that say what was wrong and how to fix it."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

__all__ = ["ServiceError", "error_response", "internal_error_response"]


class ServiceError(Exception):
    """An error with an HTTP status, a machine-readable type and, for bad input, the field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.field = field
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(
            self.status,
            self.message,
            error_type=self.error_type,
            field=self.field,
            headers=self.headers,
        )


def error_response(
    status: int,
    message: str,
    *,
    error_type: str = "invalid_request_error",
    field: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body: dict[str, Any] = {
        "error": {"message": message, "type": error_type, "param": field, "code": status}
    }
    return JSONResponse(body, status_code=status, headers=headers)


def internal_error_response() -> JSONResponse:
    """What a client sees of a bug: a 500 that points to the log, never a traceback."""
    return error_response(
        500, "internal router error; see the router's log", error_type="internal_error"
    )
