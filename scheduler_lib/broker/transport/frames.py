"""The adjacent-broker wire format: signed frames on a TCP stream.

A frame is::

    magic "SLB1" | kind (1) | flags (1) | header length (2) | body length (4)
    | header (JSON) | body | HMAC-SHA256 (32) of everything before it

The header carries the conversation protocol's fields (conversation id, direction,
sequence number, fragment index and count, services, contract, message type) and the
acknowledgements piggy-backed on it; the body is the fragment's bytes. The HMAC is keyed
by the transport key for the handshake (HELLO / WELCOME) and by the connection's session
key (derived from the key and both sides' nonces) afterwards, so a frame recorded on one
connection does not verify on another.

A frame whose fixed prefix is wrong (magic, kind, sizes) is *garbage*: the stream can no
longer be trusted and the connection is closed. A frame whose HMAC does not match is
*corrupted*: it is dropped (and not acknowledged) and the connection goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import hmac
import json
import struct
from typing import Any

MAGIC = b"SLB1"
PREFIX = struct.Struct("!4sBBHI")  # magic, kind, flags, header length, body length
MAC_SIZE = 32  # HMAC-SHA256
MAX_BODY = 16 * 1024 * 1024  # bytes; larger than any fragment we send
FLAG_NULL_BODY = 1  # the message body is NULL (not empty)


class Kind(enum.IntEnum):
    HELLO = 1  # connecting side: who I am, my nonce (signed with the transport key)
    WELCOME = 2  # accepting side: who I am, my nonce (signed with the transport key)
    MESSAGE = 3  # one fragment of a sequenced message (may carry acknowledgements)
    ACK = 4  # acknowledgements alone
    REJECT = 5  # fragments the receiver refuses, with the reason (not acknowledged)


class GarbageFrame(Exception):
    """The stream does not hold our frames (bad magic, kind or size): close it."""


class CorruptFrame(Exception):
    """A frame's signature does not match its contents: drop it, keep the connection."""

    def __init__(self, kind: int, size: int) -> None:
        super().__init__(f"{_kind_name(kind)} frame of {size} bytes failed its HMAC check")
        self.kind = kind
        self.size = size


@dataclasses.dataclass(frozen=True)
class Frame:
    kind: Kind
    header: dict[str, Any]
    body: bytes | None


def _kind_name(kind: int) -> str:
    try:
        return Kind(kind).name
    except ValueError:
        return f"kind {kind}"


def encode(kind: Kind, header: dict[str, Any], body: bytes | None, key: bytes) -> bytes:
    """One signed frame."""
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > 0xFFFF:
        raise ValueError(f"frame header of {len(head)} bytes is too large")
    data = b"" if body is None else body
    flags = FLAG_NULL_BODY if body is None else 0
    out = PREFIX.pack(MAGIC, kind, flags, len(head), len(data)) + head + data
    return out + hmac.new(key, out, hashlib.sha256).digest()


async def read(reader: asyncio.StreamReader, key: bytes, max_body: int = MAX_BODY) -> Frame:
    """Read and verify the next frame.

    :raises GarbageFrame: the stream is not ours (close the connection)
    :raises CorruptFrame: the frame did not verify (drop it)
    :raises asyncio.IncompleteReadError: the peer closed the connection
    """
    prefix = await reader.readexactly(PREFIX.size)
    magic, kind, flags, head_len, body_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise GarbageFrame(f"bad magic {magic!r} (not a scheduler_lib broker, or desynchronised)")
    if kind not in Kind._value2member_map_:
        raise GarbageFrame(f"unknown frame kind {kind}")
    if body_len > max_body:
        raise GarbageFrame(f"frame body of {body_len} bytes exceeds {max_body}")
    rest = await reader.readexactly(head_len + body_len + MAC_SIZE)
    signed, mac = prefix + rest[:-MAC_SIZE], rest[-MAC_SIZE:]
    if not hmac.compare_digest(hmac.new(key, signed, hashlib.sha256).digest(), mac):
        raise CorruptFrame(kind, len(prefix) + len(rest))
    try:
        header = json.loads(rest[:head_len])
    except ValueError as exc:  # signed but unreadable: the peer itself is broken
        raise GarbageFrame(f"unreadable frame header: {exc}") from None
    if not isinstance(header, dict):
        raise GarbageFrame("frame header is not an object")
    body = None if flags & FLAG_NULL_BODY else bytes(rest[head_len : head_len + body_len])
    return Frame(Kind(kind), header, body)


def session_key(key: bytes, connecting_nonce: str, accepting_nonce: str, direction: str) -> bytes:
    """The key that signs a connection's frames after the handshake, one per direction
    (``"out"``: from the connecting side), so a frame cannot be sent back to its sender."""
    material = f"session:{direction}:{connecting_nonce}:{accepting_nonce}".encode()
    return hmac.new(key, material, hashlib.sha256).digest()
