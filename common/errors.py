"""The one error shape every HTTP server of meshd answers with, OpenAI's:
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from dataclasses import dataclass

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
               413: "invalid_request_error", 429: "rate_limit_error"}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


@dataclass(frozen=True)
class ApiError(Exception):
    """A request a server refuses; raised anywhere below a handler, answered by `http.json_errors`."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)
