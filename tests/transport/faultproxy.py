"""A fault-injecting TCP proxy for transport tests: it sits between two brokers on
loopback, reads whole frames and drops, duplicates, reorders, delays or corrupts them, or
cuts the connection, at configurable rates and reproducibly (seeded).

A stream that does not hold our frames (bad magic, unknown kind, absurd size, or fewer
bytes than a prefix before the peer closes) is forwarded unchanged from there on, so a
test can send garbage through it and watch the broker on the other side refuse it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import threading

from scheduler_lib.broker.transport.frames import MAC_SIZE, MAGIC, MAX_BODY, PREFIX, Kind

HANDSHAKE = (Kind.HELLO.value, Kind.WELCOME.value, Kind.CONFIRM.value)
KINDS = frozenset(kind.value for kind in Kind)
STATS = (
    "connections",
    "frames",
    "dropped",
    "duplicated",
    "reordered",
    "delayed",
    "corrupted",
    "cuts",
    "stalls",
    "garbage_bytes",
)

Pair = tuple[asyncio.StreamWriter, asyncio.StreamWriter]


@dataclasses.dataclass
class Faults:
    """Per-frame probabilities (0..1) of each fault."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0  # held back and written after the next frame that way
    delay: float = 0.0  # delayed by up to max_delay seconds
    max_delay: float = 0.05
    corrupt: float = 0.0  # one byte after the prefix flipped: framing intact, HMAC broken
    cut: float = 0.0  # the whole connection closed right then
    # From this frame on, nothing more goes either way, and the connection stays open: a
    # peer gone without a reset (a pulled cable, a NAT that forgot the connection).
    stall: float = 0.0
    reorder_hold: float = 0.05  # seconds a held frame waits for a next one at most
    spare_handshake: bool = True  # HELLO / WELCOME go through untouched


class FaultProxy:
    """Forwards connections from its own port to ``target``, faulting frames: those the
    target sends back by ``answer_faults`` when given (acknowledgements lost, say, while
    messages get through), else by ``faults`` like the others.

    Each direction of each connection draws its faults from its own generator, seeded by
    ``seed``, the connection's number and the direction, so a run's faults depend only on
    the frames sent and not on how the two directions interleave.
    """

    def __init__(
        self,
        target: tuple[str, int],
        faults: Faults,
        *,
        seed: int = 0,
        listen_host: str = "127.0.0.1",
        answer_faults: Faults | None = None,
    ) -> None:
        self.target = target
        self.faults = faults
        self.answer_faults = answer_faults
        self.seed = seed
        self.listen_host = listen_host
        self._stats = dict.fromkeys(STATS, 0)
        self._port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._pairs: set[Pair] = set()
        self._stalled: set[Pair] = set()  # connections that forward nothing any more
        self._handlers: set[asyncio.Task[None]] = set()
        self._error: BaseException | None = None

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> FaultProxy:
        """Listen (on a free port) and serve from a daemon thread; returns when listening."""
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fault proxy did not start")
        if self._error is not None:
            raise RuntimeError(f"the fault proxy did not start: {self._error}")
        return self

    def stop(self) -> None:
        """Close the listener and every connection; join the thread."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return f"tcp://{self.listen_host}:{self._port}"

    @property
    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def set_faults(self, faults: Faults) -> None:
        """New rates from the next frame on (the object is replaced, never mutated)."""
        self.faults = faults

    def cut_all(self) -> int:
        """Close every proxied connection now; how many there were."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return 0
        try:
            future = asyncio.run_coroutine_threadsafe(self._cut_all(), loop)
        except RuntimeError:  # the loop closed meanwhile
            return 0
        return future.result(timeout=5)

    def stall_all(self) -> int:
        """From now on every proxied connection forwards nothing, and stays open (a peer
        gone without a reset); how many there were. New connections are not stalled."""
        loop = self._loop
        assert loop is not None
        return asyncio.run_coroutine_threadsafe(self._stall_all(), loop).result(timeout=5)

    async def _stall_all(self) -> int:
        self._stalled.update(self._pairs)
        return len(self._pairs)

    async def _cut_all(self) -> int:
        pairs = list(self._pairs)
        for pair in pairs:
            self._close(pair)
        return len(pairs)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start(); never a thread traceback
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._accept, self.listen_host, 0)
        self._port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        server.close()
        for pair in list(self._pairs):
            self._close(pair)
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=1)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1)

    # --- one proxied connection --------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._stats["connections"] += 1
        number = self._stats["connections"]
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        pair: Pair | None = None
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                return
            pair = (writer, up_writer)
            self._pairs.add(pair)
            await asyncio.gather(
                self._pump(reader, up_writer, self._rng(number, "out"), pair),
                self._pump(up_reader, writer, self._rng(number, "in"), pair, answers=True),
                return_exceptions=True,
            )
        except asyncio.CancelledError:  # stop(): the connection ends here
            pass
        finally:
            if pair is not None:
                self._close(pair)
            else:
                with contextlib.suppress(Exception):
                    writer.close()
            if task is not None:
                self._handlers.discard(task)

    def _rng(self, number: int, direction: str) -> random.Random:
        return random.Random(f"{self.seed}:{number}:{direction}")

    def _close(self, pair: Pair) -> None:
        self._pairs.discard(pair)
        self._stalled.discard(pair)
        for w in pair:
            with contextlib.suppress(Exception):
                w.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        rng: random.Random,
        pair: Pair,
        *,
        answers: bool = False,
    ) -> None:
        held: list[bytes] = []
        flusher: asyncio.Task[None] | None = None

        def release() -> None:
            nonlocal flusher
            while held:
                writer.write(held.pop(0))
            if flusher is not None and flusher is not asyncio.current_task():
                flusher.cancel()
            flusher = None

        async def release_later(hold: float) -> None:
            await asyncio.sleep(hold)
            with contextlib.suppress(Exception):
                release()

        try:
            while True:
                is_frame, frame = await self._read_frame(reader)
                if not is_frame:  # not our frames: forward it and the rest unchanged
                    release()
                    await self._forward_raw(frame, reader, writer)
                    return
                self._stats["frames"] += 1
                faults = self.faults
                if pair in self._stalled:
                    continue
                if answers and self.answer_faults is not None:
                    faults = self.answer_faults
                if faults.spare_handshake and frame[4] in HANDSHAKE:
                    writer.write(frame)
                    await writer.drain()
                    continue
                if rng.random() < faults.cut:
                    self._stats["cuts"] += 1
                    self._close(pair)
                    return
                if rng.random() < faults.stall:
                    self._stats["stalls"] += 1
                    self._stalled.add(pair)
                    continue
                if rng.random() < faults.drop:
                    self._stats["dropped"] += 1
                    continue
                if rng.random() < faults.corrupt:
                    self._stats["corrupted"] += 1
                    at = rng.randrange(PREFIX.size, len(frame))
                    frame = frame[:at] + bytes([frame[at] ^ 0xFF]) + frame[at + 1 :]
                if rng.random() < faults.delay:
                    self._stats["delayed"] += 1
                    await asyncio.sleep(rng.uniform(0, faults.max_delay))
                copies = 1
                if rng.random() < faults.duplicate:
                    self._stats["duplicated"] += 1
                    copies = 2
                if rng.random() < faults.reorder and not held:
                    self._stats["reordered"] += 1
                    held.extend([frame] * copies)
                    flusher = asyncio.create_task(release_later(faults.reorder_hold))
                    continue
                for _ in range(copies):
                    writer.write(frame)
                release()  # a held frame goes after this one
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError, RuntimeError):
            return
        except asyncio.CancelledError:
            return
        finally:
            if flusher is not None:
                flusher.cancel()
            self._close(pair)

    async def _forward_raw(
        self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Forward ``first`` and everything after it unchanged, until EOF."""
        data = first
        while data:
            self._stats["garbage_bytes"] += len(data)
            writer.write(data)
            await writer.drain()
            data = await reader.read(65536)

    async def _read_frame(self, reader: asyncio.StreamReader) -> tuple[bool, bytes]:
        """(True, the next whole frame), or (False, what was read) when the stream is not
        made of our frames.

        The prefix is read as it comes, and given up on as soon as its first bytes cannot
        be the magic, so garbage shorter than a prefix still goes through at once.

        :raises asyncio.IncompleteReadError: the peer closed between frames or mid-frame
        """
        prefix = b""
        while len(prefix) < PREFIX.size:
            chunk = await reader.read(PREFIX.size - len(prefix))
            if not chunk:
                if not prefix:
                    raise asyncio.IncompleteReadError(b"", PREFIX.size)
                return False, prefix  # a stub shorter than a prefix: forward it
            prefix += chunk
            if not MAGIC.startswith(prefix[: len(MAGIC)]):
                return False, prefix
        _magic, kind, _flags, head_len, body_len = PREFIX.unpack(prefix)
        if kind not in KINDS or body_len > MAX_BODY:
            return False, prefix
        return True, prefix + await reader.readexactly(head_len + body_len + MAC_SIZE)
