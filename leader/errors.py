"""OpenAI-shaped error objects for every error the HTTP API returns."""

from __future__ import annotations

from litestar import Request, Response
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 408: "timeout", 409: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


class ApiError(HTTPException):
    """An error with OpenAI's fields: message, type, param, code."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(status_code=status, detail=message, headers=headers)
        self.code = code
        self.param = param
        self.type_ = type_ or _TYPES.get(status, "api_error")


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _handle(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ApiError):
        return Response(error_body(exc.detail, exc.type_, exc.code, exc.param), status_code=exc.status_code,
                        headers=exc.headers)
    if isinstance(exc, ValidationException):
        extra = exc.extra if isinstance(exc.extra, list) else []
        param = extra[0].get("key") if extra and isinstance(extra[0], dict) else None
        msg = exc.detail
        if extra and isinstance(extra[0], dict) and extra[0].get("message"):
            msg = f"{exc.detail}: {extra[0]['message']}"
        return Response(error_body(msg, "invalid_request_error", "invalid_request", param), status_code=400)
    if isinstance(exc, HTTPException) and exc.status_code == 413:  # over the app's request_max_body_size
        limit = request.route_handler.resolve_request_max_body_size()
        return Response(error_body(f"The request body is larger than {limit} bytes (SWARM_HTTP_MAX_BODY_BYTES)",
                                   "invalid_request_error", "request_too_large"), status_code=413)
    if isinstance(exc, NotFoundException):
        return Response(error_body(exc.detail or "Not found", "invalid_request_error", "not_found"),
                        status_code=404)
    if isinstance(exc, HTTPException):
        return Response(error_body(exc.detail, _TYPES.get(exc.status_code, "api_error")),
                        status_code=exc.status_code, headers=exc.headers)
    request.logger.exception("unhandled error on %s", request.url.path)
    return Response(error_body("internal error", "api_error", "internal_error"),
                    status_code=HTTP_500_INTERNAL_SERVER_ERROR)


exception_handlers = {Exception: _handle}


def renamed_as(exc: ApiError, names: dict[str, str]) -> ApiError:
    """A chat check's error in the names of an API translated onto chat (``names``: chat's name to its own),
    in its message and its param."""
    for chat, name in names.items():
        exc.detail = exc.detail.replace(f"'{chat}'", f"'{name}'")
        if exc.param == chat:
            exc.param = name
    return exc
