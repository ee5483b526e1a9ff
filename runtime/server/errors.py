"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every 4xx/5xx.

Handlers turn our APIError, Starlette's HTTP errors (404, 405) and anything unexpected
(500) into that body, so a client always gets JSON that says what went wrong.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.metrics import ServerMetrics

logger = logging.getLogger(__name__)
_Model = TypeVar("_Model", bound=pydantic.BaseModel)

MAX_BODY_BYTES = 8 << 20
# Deeper bodies are refused before validation: the JSON parser and pydantic both recurse,
# and a JSON schema or tool definition never needs more.
MAX_JSON_DEPTH = 64

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    """An error reply. `param` names the offending request field, where there is one."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def reply(status: int, message: str, param: str | None = None, code: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.http_errors.labels(str(status)).inc()
        return JSONResponse(error_body(status, message, param, code), status, headers=headers)

    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        return reply(e.status, e.message, e.param, e.code, e.headers)

    async def on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return reply(e.status_code, str(e.detail), headers=e.headers)

    async def on_query_error(_: Request, e: RequestValidationError) -> JSONResponse:
        # Route parameters FastAPI checks itself (the debug routes' query): 400, not 422.
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"][1:]) or None
        return reply(400, f"{param}: {err['msg']}", param, "invalid_value")

    async def on_unexpected(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=e)
        return reply(500, f"internal server error: {type(e).__name__}", code="internal_error")

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_query_error)
    app.add_exception_handler(Exception, on_unexpected)


async def read_json(request: Request, max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The body as a JSON object; 413 past `max_bytes` (checked before reading it when the
    client declares a length), 400 for anything that is not a JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(len(body), max_bytes)
    try:
        data = json.loads(body)
    except RecursionError as e:
        raise APIError(400, f"the request body is nested too deeply for the JSON parser (at "
                       f"most {MAX_JSON_DEPTH} levels)", code="invalid_json") from e
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer past 4,300 digits
        raise APIError(400, f"the request body is not valid JSON: {e}",
                       code="invalid_json") from e
    if _depth_over(data, MAX_JSON_DEPTH):
        raise APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels "
                       f"deep", code="invalid_json")
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not "
                       f"{type(data).__name__}", code="invalid_json")
    return data


async def read_model(request: Request, model: type[_Model]) -> _Model:
    """The body as `model`; a body that does not fit it is a 400 naming the field."""
    try:
        return model.model_validate(await read_json(request))
    except pydantic.ValidationError as e:
        raise validation_error(e) from e


def _depth_over(data: Any, limit: int) -> bool:
    """Whether containers nest deeper than `limit` (iterative: no recursion to overflow)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > limit:
                return True
            children = value.values() if isinstance(value, dict) else value
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body of {size} bytes is over the limit of {limit} bytes",
                    code="request_too_large")


# Union members in pydantic's error locations ("str", "list[int]", a model's class name),
# not field names (which are all snake_case).
_TYPE_TAG = re.compile(r"^([A-Z].*|str|int|float|bool|none|.*\[.*\]|function-.*)$")


def validation_error(e: pydantic.ValidationError) -> APIError:
    """The most specific problem pydantic found (the deepest location: for a union, the
    branch the client evidently meant), as a 400 naming the field."""
    err = max(e.errors(include_url=False), key=lambda x: len(x["loc"]))
    loc = [str(p) for p in err["loc"] if not _TYPE_TAG.match(str(p))]
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        message = "this field is required"
    return APIError(400, f"{param}: {message}" if param else message, param=param,
                    code="invalid_value")
