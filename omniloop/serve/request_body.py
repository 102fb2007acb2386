"""Reading and decoding JSON request bodies, with the size limit and OpenAI-style errors."""

from __future__ import annotations

from typing import TypeVar

import msgspec
from starlette.requests import Request

from omniloop.log import get_logger
from omniloop.serve.api_errors import ApiError

log = get_logger(__name__)

T = TypeVar("T", bound=msgspec.Struct)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, refusing (413) as soon as it is known to exceed ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {max_bytes}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(raw: bytes, schema: type[T], endpoint: str) -> T:
    """JSON object -> ``schema``. Unknown fields are ignored and logged (vLLM behaves the same)."""
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        body = msgspec.convert(data, schema)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}", _param_of(str(exc))) from None
    unknown = set(data) - set(schema.__struct_fields__)
    if unknown:
        log.warning("ignored unknown request fields", endpoint=endpoint, fields=sorted(unknown))
    return body


def _param_of(message: str) -> str | None:
    """msgspec says "... - at `$.field`"; the field name is OpenAI's ``param``."""
    marker = "at `$."
    at = message.rfind(marker)
    if at < 0:
        return None
    return message[at + len(marker):].rstrip("`").split("[")[0].split(".")[0] or None
