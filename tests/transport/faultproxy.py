"""A fault-injecting TCP proxy for transport tests: it sits between two brokers on
loopback, reads whole frames and drops, duplicates, reorders, delays or corrupts them, or
cuts the connection, at configurable rates and reproducibly (seeded)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import threading

from scheduler_lib.broker.transport.frames import MAC_SIZE, MAGIC, PREFIX, Kind

HANDSHAKE = (Kind.HELLO.value, Kind.WELCOME.value)


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
    reorder_hold: float = 0.05  # seconds a held frame waits for a next one at most
    spare_handshake: bool = True  # HELLO / WELCOME go through untouched


class FaultProxy:
    """Forwards connections from its own port to ``target``, faulting frames."""

    def __init__(
        self,
        target: tuple[str, int],
        faults: Faults,
        *,
        seed: int = 0,
        listen_host: str = "127.0.0.1",
    ) -> None:
        self.target = target
        self.faults = faults
        self.seed = seed
        self.listen_host = listen_host
        self._stats = dict.fromkeys(
            (
                "connections",
                "frames",
                "dropped",
                "duplicated",
                "reordered",
                "delayed",
                "corrupted",
                "cuts",
                "garbage_bytes",
            ),
            0,
        )
        self._port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fault proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
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
        self.faults = faults

    def cut_all(self) -> int:
        """Close every proxied connection now; how many there were."""
        if self._loop is None:
            return 0
        future = asyncio.run_coroutine_threadsafe(self._cut_all(), self._loop)
        return future.result(timeout=5)

    async def _cut_all(self) -> int:
        pairs = list(self._pairs)
        for pair in pairs:
            self._close(pair)
        return len(pairs)

    def _run(self) -> None:
        asyncio.run(self._main())

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
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)

    # --- one proxied connection --------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._stats["connections"] += 1
        rng = random.Random(self.seed * 1000 + self._stats["connections"])
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        await asyncio.gather(
            self._pump(reader, up_writer, rng, pair),
            self._pump(up_reader, writer, rng, pair),
            return_exceptions=True,
        )
        self._close(pair)

    def _close(self, pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        self._pairs.discard(pair)
        for w in pair:
            with contextlib.suppress(Exception):
                w.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        rng: random.Random,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        held: list[bytes] = []
        flush: asyncio.Task[None] | None = None

        async def flush_later() -> None:
            await asyncio.sleep(self.faults.reorder_hold)
            while held:
                writer.write(held.pop(0))

        try:
            while True:
                is_frame, frame = await self._read_frame(reader)
                if not is_frame:  # not our frames: forward it and the rest unchanged
                    writer.write(frame)
                    while data := await reader.read(65536):
                        self._stats["garbage_bytes"] += len(data)
                        writer.write(data)
                        await writer.drain()
                    return
                self._stats["frames"] += 1
                faults = self.faults
                if faults.spare_handshake and frame[4] in HANDSHAKE:
                    writer.write(frame)
                    await writer.drain()
                    continue
                if rng.random() < faults.cut:
                    self._stats["cuts"] += 1
                    self._close(pair)
                    return
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
                    flush = asyncio.create_task(flush_later())
                    continue
                for _ in range(copies):
                    writer.write(frame)
                while held:  # the held frame goes after this one
                    writer.write(held.pop(0))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            return
        except asyncio.CancelledError:
            return
        finally:
            if flush is not None:
                flush.cancel()
            self._close(pair)

    async def _read_frame(self, reader: asyncio.StreamReader) -> tuple[bool, bytes]:
        """(True, the next whole frame), or (False, what was read) when the stream is not
        made of our frames."""
        prefix = await reader.readexactly(PREFIX.size)
        magic, _kind, _flags, head_len, body_len = PREFIX.unpack(prefix)
        if magic != MAGIC:
            self._stats["garbage_bytes"] += len(prefix)
            return False, prefix
        return True, prefix + await reader.readexactly(head_len + body_len + MAC_SIZE)
