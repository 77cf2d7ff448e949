"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status.

Every refusal the server makes is an ``APIError``; the app turns it into that
JSON body, so a client library raises its usual exception class for it
(``openai.BadRequestError`` for 400, ``RateLimitError`` for 429, ...).
"""

from __future__ import annotations

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": _unicode(param),
                      "code": code}}


def _unicode(param: str | None) -> str | None:
    """``param`` as valid Unicode: a name echoed from the request may hold a lone surrogate
    (an unknown field's), which strict JSON parsers refuse even escaped; it is written as
    its escape sequence's text instead."""
    if param is None:
        return None
    return param.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
