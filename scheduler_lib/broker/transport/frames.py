"""The adjacent-broker wire format: signed frames on a TCP stream.

A frame is::

    magic "SLB1" | kind (1) | flags (1) | header length (2) | body length (4)
    | header (JSON) | body | HMAC-SHA256 (32) of everything before it

The header carries the conversation protocol's fields (conversation id, direction,
sequence number, fragment index and count, services, contract, message type) and the
acknowledgements piggy-backed on it; the body is the fragment's bytes. The HMAC is keyed
by the transport key for the handshake and by the connection's session key afterwards, so
a frame recorded on one connection does not verify on another.

The handshake authenticates both sides with fresh nonces, so that a recording replayed
later proves nothing:

1. HELLO (dialler -> acceptor): its broker instance and a fresh nonce.
2. WELCOME (acceptor -> dialler): its broker instance, a fresh nonce, and a proof: an HMAC
   over both nonces and both instances, keyed by a key derived from the transport key and
   both nonces. A replayed WELCOME carries the proof of another HELLO's nonce; the dialler
   sends nothing until the proof holds.
3. CONFIRM (dialler -> acceptor): the dialler's proof over the same, under another
   derived key. A replayed HELLO gets its WELCOME, but without the key nobody can answer
   its fresh nonce; the acceptor closes the connection at any other first frame.

The proof keys and both directions' session keys come from HKDF-SHA256 (RFC 5869, from
``cryptography``) of the transport key, salted with both nonces, over the two instances.

Every frame signed with a session key carries its number in its direction of the
connection (header field ``#``: the CONFIRM is 0, each later frame one more). The receiver
accepts only a number above the last it accepted: a frame recorded on a connection and
written into it again (a replay within the connection, which the session key alone does
not stop), or moved within it, is dropped. TCP keeps a connection's bytes in order, so an
honest peer's numbers only rise.

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

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"SLB1"
PREFIX = struct.Struct("!4sBBHI")  # magic, kind, flags, header length, body length
MAC_SIZE = 32  # HMAC-SHA256
MAX_BODY = 16 * 1024 * 1024  # bytes; larger than any fragment we send
FLAG_NULL_BODY = 1  # the message body is NULL (not empty)
# The first bytes of a TLS record (handshake, alert; TLS 1.0-1.3 all say 3.x): what a peer
# that speaks TLS sends where a frame was expected.
TLS_RECORDS = frozenset({b"\x16\x03", b"\x15\x03"})


class Kind(enum.IntEnum):
    HELLO = 1  # dialler: who I am, my nonce (signed with the transport key)
    WELCOME = 2  # acceptor: who I am, my nonce, my proof over both (signed with the key)
    MESSAGE = 3  # one fragment of a sequenced message (may carry acknowledgements)
    ACK = 4  # acknowledgements alone
    REJECT = 5  # fragments the receiver refuses, with the reason (not acknowledged)
    CONFIRM = 6  # dialler: my proof over both nonces (signed with its session key)


NUMBER = "#"  # header field: the frame's number in its direction of the connection
HANDSHAKE_KINDS = frozenset({Kind.HELLO, Kind.WELCOME, Kind.CONFIRM})
NONCE_BYTES = 16  # random bytes of each side's nonce (sent as 32 hex digits)


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
        if magic[:2] in TLS_RECORDS:
            raise GarbageFrame(
                "a TLS handshake: the peer uses TLS and this side does not (give both "
                "endpoints TLS, --tls-cert/--tls-key, or neither)"
            )
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
    except (ValueError, RecursionError) as exc:  # signed but unreadable: a broken peer
        raise GarbageFrame(f"unreadable frame header: {exc}") from None
    if not isinstance(header, dict):
        raise GarbageFrame("frame header is not an object")
    body = None if flags & FLAG_NULL_BODY else bytes(rest[head_len : head_len + body_len])
    return Frame(Kind(kind), header, body)


@dataclasses.dataclass(frozen=True)
class HandshakeKeys:
    """What one handshake derives: each side's proof and each direction's session key
    (``out``: the dialler's frames, ``in``: the acceptor's)."""

    welcome_proof: str  # hex: what the acceptor's WELCOME must carry
    confirm_proof: str  # hex: what the dialler's CONFIRM must carry
    send_out: bytes
    send_in: bytes


def handshake_keys(
    key: bytes, dialler_nonce: str, acceptor_nonce: str, dialler: str, acceptor: str
) -> HandshakeKeys:
    """The keys and proofs of one handshake, from the transport key, both nonces (hex,
    :data:`NONCE_BYTES` each) and both broker instances.

    :raises ValueError: a nonce that is not :data:`NONCE_BYTES` bytes of hex (a peer that
        is not ours: close the connection)
    """
    nonces = [bytes.fromhex(n) for n in (dialler_nonce, acceptor_nonce)]
    if any(len(n) != NONCE_BYTES for n in nonces):
        raise ValueError(f"a nonce must be {NONCE_BYTES} bytes")
    transcript = json.dumps(["scheduler_lib transport 2", dialler, acceptor]).encode()
    material = HKDF(
        algorithm=hashes.SHA256(), length=4 * 32, salt=nonces[0] + nonces[1], info=transcript
    ).derive(key)
    welcome, confirm, out, back = (material[i : i + 32] for i in range(0, 128, 32))
    return HandshakeKeys(
        welcome_proof=hmac.new(welcome, b"WELCOME" + transcript, hashlib.sha256).hexdigest(),
        confirm_proof=hmac.new(confirm, b"CONFIRM" + transcript, hashlib.sha256).hexdigest(),
        send_out=out,
        send_in=back,
    )


def proof_holds(given: object, expected: str) -> bool:
    """Whether a proof a peer sent is the expected one (in constant time)."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


class ReplayGuard:
    """The frame numbers of one direction of a connection: each must be above the last
    one accepted. TCP delivers a connection's bytes in order, so an honest peer's
    numbers only rise (with gaps where a corrupted frame was dropped); a number not
    above the last is a frame written into the stream again, or moved in it. Starts with
    the CONFIRM's 0 accepted."""

    def __init__(self) -> None:
        self.highest = 0

    def accept(self, number: object) -> bool:
        """Whether a frame numbered ``number`` comes after every frame accepted so far
        (and from now on, the last accepted).

        :raises GarbageFrame: no number, or not a non-negative integer: a signed frame
            only a broken peer writes
        """
        if type(number) is not int or number < 0:
            raise GarbageFrame(f"frame number {number!r} is not a non-negative integer")
        if number <= self.highest:
            return False
        self.highest = number
        return True
