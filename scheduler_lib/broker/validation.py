"""Checks on message bodies and call arguments, before anything is written."""

from __future__ import annotations

import importlib
import itertools
import json
import math
import re
import uuid
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from typing import Any

from scheduler_lib.broker import exceptions, models

NAME_MAX_LENGTH = 128  # characters, SQL Server's sysname
INT_MAX = 2**31 - 1  # the largest count or id a column holds on every backend (int4)
# Levels of arrays and objects a JSON body may nest: deeper bodies are refused before they
# are parsed (a recursive parser would run out of stack on them). serde_json's default.
MAX_JSON_DEPTH = 128
# The Error code of a message that fails its type's validation where it arrives (from
# another broker, or held locally while its queue was off): SQL Server's.
INVALID_MESSAGE_CODE = -9617

Body = bytes | bytearray | memoryview | str | None


def name(value: Any, what: str) -> str:
    """A catalog object's name: a non-empty string of at most 128 characters."""
    if not isinstance(value, str) or not value.strip():
        raise exceptions.InvalidArgument(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > NAME_MAX_LENGTH:
        raise exceptions.InvalidArgument(
            f"{what} is longer than {NAME_MAX_LENGTH} characters: {value[:40]!r}..."
        )
    return value


def handle(value: Any, what: str = "conversation handle") -> str:
    """A conversation handle or group id (UUID or its text) in canonical text form."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, str):
        try:
            return str(uuid.UUID(value))
        except ValueError:
            pass
    raise exceptions.InvalidArgument(f"{what} must be a UUID, got {value!r}")


def timeout(value: Any, what: str = "timeout") -> float | None:
    """``None`` (wait forever) or a finite number of seconds >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise exceptions.InvalidArgument(
            f"{what} must be a number of seconds or None, got {value!r}"
        )
    if value < 0:
        raise exceptions.InvalidArgument(f"{what} must not be negative, got {value!r}")
    if math.isinf(value):
        raise exceptions.InvalidArgument(
            f"{what} must be finite, got {value!r}", hint="None means wait forever"
        )
    return float(value)


def positive_int(value: Any, what: str) -> int:
    """An integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise exceptions.InvalidArgument(f"{what} must be an integer >= 1, got {value!r}")
    return value


def bounded_int(value: Any, what: str, low: int = 0, high: int = INT_MAX) -> int:
    """An integer (not a bool) from ``low`` to ``high``, both included."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise exceptions.InvalidArgument(
            f"{what} must be an integer from {low} to {high}, got {_short(value)}"
        )
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def body_bytes(body: Body, max_size: int) -> bytes | None:
    """The body as bytes (``str`` is UTF-8), refusing other types and oversized bodies."""
    if body is None:
        return None
    if isinstance(body, str):
        data = body.encode("utf-8")
    elif isinstance(body, bytes | bytearray | memoryview):
        data = bytes(body)
    else:
        raise exceptions.InvalidArgument(
            f"message body must be bytes, str or None, got {type(body).__name__}",
            hint="encode structured data yourself, e.g. json.dumps(obj)",
        )
    if len(data) > max_size:
        raise exceptions.MessageTooLarge(
            f"message body is {len(data)} bytes; the broker accepts at most {max_size}"
        )
    return data


def check_body(message_type: str, validation: models.Validation, body: bytes | None) -> None:
    """Apply a message type's validation; an empty body passes every validation but EMPTY's
    opposite (as in SQL Server, empty messages are not validated).

    :raises InvalidMessageBody: naming the message type and what is wrong
    """
    if validation is models.Validation.NONE or not body:
        return
    if validation is models.Validation.EMPTY:
        raise exceptions.InvalidMessageBody(
            f"message type {message_type!r} has VALIDATION = EMPTY "
            f"but the body has {len(body)} bytes"
        )
    if validation is models.Validation.WELL_FORMED_XML:
        try:
            ElementTree.fromstring(body)
        except ElementTree.ParseError as exc:
            raise exceptions.InvalidMessageBody(
                f"message type {message_type!r} requires well-formed XML: {exc}"
            ) from None
    elif validation is models.Validation.JSON:
        try:
            text = body.decode(json.detect_encoding(body), "surrogatepass")  # as json.loads
        except UnicodeDecodeError as exc:
            raise exceptions.InvalidMessageBody(
                f"message type {message_type!r} requires a JSON body: {exc}"
            ) from None
        if text.count("[") + text.count("{") > MAX_JSON_DEPTH and (
            json_depth(text) > MAX_JSON_DEPTH
        ):
            raise exceptions.InvalidMessageBody(
                f"message type {message_type!r}: the JSON body nests arrays and objects "
                f"more than {MAX_JSON_DEPTH} levels deep"
            )
        try:
            json.loads(text, parse_constant=_reject_constant)
        except ValueError as exc:
            raise exceptions.InvalidMessageBody(
                f"message type {message_type!r} requires a JSON body: {exc}"
            ) from None


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """How deep the arrays and objects of a JSON text nest, measured without parsing it
    (so without recursion, whatever the depth): its brackets outside strings, counted."""
    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text))
    steps = (1 if c in "[{" else -1 for c in brackets)
    return max(itertools.accumulate(steps, initial=0))


def _reject_constant(constant: str) -> Any:
    # NaN and Infinity are Python's extension, not JSON (RFC 8259); other readers refuse them.
    raise ValueError(f"{constant} is not valid JSON")


def resolve(dotted: str, what: str = "activation procedure") -> Callable[..., Any]:
    """The callable named by ``package.module.function`` or ``package.module:function``.

    :raises InvalidArgument: when it cannot be imported
    """
    module_name, _, attribute = dotted.replace(":", ".").rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise exceptions.InvalidArgument(f"cannot import {what} {dotted!r}: {exc}") from None
    if not callable(target):
        raise exceptions.InvalidArgument(f"{what} {dotted!r} is not callable")
    return target
