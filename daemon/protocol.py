"""What every API face shares on the wire: the one error (ApiError, which each face puts in its own shape),
reading a JSON body within the daemon's limits (size, nesting, text that is Unicode) and validating it with
pydantic so that a refusal names the field as the client wrote it, and the strict number types the bodies use
(no "1" for 1, no NaN or Infinity)."""

from __future__ import annotations

import json
import math
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, Field, Strict, ValidationError

MAX_BODY_BYTES = 4 * 2**20
# Levels of objects and arrays a body may nest: every walk over it after parsing (validation, schemas) is bounded
# by this, where a body nested past Python's recursion limit reached a 500.
MAX_BODY_DEPTH = 128

Float = Annotated[float, Field(allow_inf_nan=False)]


def _whole_number(value):
    """5.0 is an integer in JSON Schema's terms (and some clients' encoders write it so): take it as 5."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer, strictly (no "5", no true), where a float with no fraction counts as one.
Int = Annotated[int, BeforeValidator(_whole_number), Strict()]


class ApiError(Exception):
    """An error answered with the one JSON error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _nested_past(data, limit: int) -> str | None:
    """The path of the first object or array nested deeper than `limit` levels, or None (no recursion)."""
    stack = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in items:
            if isinstance(child, (dict, list)):
                where = f"{path}.{key}" if path else str(key)
                if depth >= limit:
                    return where
                stack.append((child, where, depth + 1))
    return None


def parse_body(raw: bytes, model: type[BaseModel]):
    """Parse and validate a JSON body, raising ApiError(400) that names the field."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", None, "body_too_large")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(
            400, f"body nests deeper than {MAX_BODY_DEPTH} levels of objects and arrays", None, "too_deep"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "body must be a JSON object", None, "invalid_type")
    deep = _nested_past(data, MAX_BODY_DEPTH)
    if deep is not None:  # named by its first few keys: the whole path is as long as the nesting
        field = ".".join(deep.split(".")[:4])
        raise ApiError(
            400, f"{field}: nests deeper than {MAX_BODY_DEPTH} levels of objects and arrays", field, "too_deep"
        )
    where = _lone_surrogate(data)
    if where is not None:
        raise ApiError(
            400,
            f"{where}: holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not text",
            where,
            "invalid_unicode",
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # A union reports each branch it tried; the one that reached deepest into the body says what is wrong,
        # and the field is named by the body's own keys and indexes, not the branches' labels.
        paths = [_body_path(data, e) for e in exc.errors()]
        at = max(range(len(paths)), key=lambda i: len(paths[i]))
        err = exc.errors()[at]
        param = ".".join(paths[at]) or None
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        value = err.get("input")
        shown = (
            ""
            if err["type"] in ("missing", "extra_forbidden") or isinstance(value, (dict, list))
            else f" (got {_short(value)})"
        )
        raise ApiError(400, f"{param}: {msg}{shown}", param, err["type"]) from None


def _body_path(data, err: dict) -> list[str]:
    """The error's location as the client wrote it: the keys and indexes that lead into the body, without the
    labels pydantic gives a union's branches (`str`, `list[...]`, a tag); a missing field's name ends it."""
    parts, node, loc = [], data, err["loc"]
    for i, p in enumerate(loc):
        if isinstance(node, dict) and isinstance(p, str) and p in node:
            parts.append(p)
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and not isinstance(p, bool) and 0 <= p < len(node):
            parts.append(str(p))
            node = node[p]
        elif p == "[key]" or (i == len(loc) - 1 and err["type"] == "missing" and isinstance(p, str)):
            parts.append(p)  # the key itself is what is wrong; or the field that is missing
    return parts


def _lone_surrogate(value, path: str = "") -> str | None:
    """The path of the first string (or key) holding an unpaired surrogate, which no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        here = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _lone_surrogate(key) is not None:
            return here
        found = _lone_surrogate(item, here)
        if found is not None:
            return found
    return None


def _short(value) -> str:
    text = repr(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."
