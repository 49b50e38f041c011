"""HTTP conventions shared by asyncrl's services: one JSON error envelope, body-size limits."""

from asyncrl.http.errors import (
    ApiError,
    BodySizeLimit,
    error_body,
    error_response,
    install_error_handlers,
)

__all__ = ["ApiError", "BodySizeLimit", "error_body", "error_response", "install_error_handlers"]
