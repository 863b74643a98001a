"""Errors as OpenAI's API returns them: a status code and {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from starlette.responses import JSONResponse

from llama_chat.storage import StoreError

INVALID = "invalid_request_error"


class ApiError(Exception):
    """A request the server refuses, said in one line; nothing was stored or computed for it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def context_length_exceeded(prompt_tokens: int | None, n_ctx: int, param: str = "messages") -> ApiError:
    """prompt_tokens None: tokenizing stopped once the prompt reached n_ctx tokens."""
    size = f"{n_ctx:,} tokens or more" if prompt_tokens is None else f"{prompt_tokens:,} tokens"
    return invalid(
        f"'{param}' makes {size}; this server's context window holds {n_ctx:,} "
        "(llama-chat serve --ctx), and a reply needs at least one more.",
        param=param,
        code="context_length_exceeded",
    )


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "A valid API key is needed: send the header 'Authorization: Bearer KEY'.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def forbidden(message: str, code: str) -> ApiError:
    return ApiError(403, message, code=code)


def model_not_found(name: str, served: str) -> ApiError:
    message = f"The model '{name}' does not exist here; this server runs '{served}'."
    return ApiError(404, message, param="model", code="model_not_found")


def session_not_found(message: str) -> ApiError:
    return ApiError(404, message[:1].upper() + message[1:] + ".", param="session", code="session_not_found")


def too_large(limit: int) -> ApiError:
    message = f"The request body is over this server's limit of {limit:,} bytes."
    return ApiError(413, message, code="request_too_large")


WAITING = "Too many requests are waiting already; retry in a moment."


def busy(retry_after: int, message: str = WAITING) -> ApiError:
    headers = {"Retry-After": str(retry_after)}
    return ApiError(429, message, type="requests", code="rate_limit_exceeded", headers=headers)


def unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, type="server_error", code=code, headers={"Retry-After": "1"})


def server_error(message: str) -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error")


def storage_failed(e: StoreError) -> ApiError:
    """The database could not be used: 507 when the disk is full, else 500; said without its path."""
    message = f"The server's database failed: {e.brief or 'see the server log'}."
    if e.full:
        return ApiError(507, message, type="server_error", code="disk_full")
    return ApiError(500, message, type="server_error", code="storage_error")
