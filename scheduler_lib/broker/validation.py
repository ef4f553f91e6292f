"""Checks on message bodies and call arguments, before anything is written."""

from __future__ import annotations

import json
import math
import uuid
import xml.etree.ElementTree as ElementTree
from typing import Any

from scheduler_lib.broker import exceptions
from scheduler_lib.broker.models import Validation

NAME_MAX_LENGTH = 128  # characters, SQL Server's sysname

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


def check_body(message_type: str, validation: Validation, body: bytes | None) -> None:
    """Apply a message type's validation; an empty body passes every validation but EMPTY's
    opposite (as in SQL Server, empty messages are not validated).

    :raises InvalidMessageBody: naming the message type and what is wrong
    """
    if validation is Validation.NONE or not body:
        return
    if validation is Validation.EMPTY:
        raise exceptions.InvalidMessageBody(
            f"message type {message_type!r} has VALIDATION = EMPTY "
            f"but the body has {len(body)} bytes"
        )
    if validation is Validation.WELL_FORMED_XML:
        try:
            ElementTree.fromstring(body)
        except ElementTree.ParseError as exc:
            raise exceptions.InvalidMessageBody(
                f"message type {message_type!r} requires well-formed XML: {exc}"
            ) from None
    elif validation is Validation.JSON:
        try:
            json.loads(body, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            raise exceptions.InvalidMessageBody(
                f"message type {message_type!r} requires a JSON body: {exc}"
            ) from None


def _reject_constant(constant: str) -> Any:
    # NaN and Infinity are Python's extension, not JSON (RFC 8259); other readers refuse them.
    raise ValueError(f"{constant} is not valid JSON")
