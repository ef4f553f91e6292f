"""What the endpoint refuses, told at a bounded rate: transport events and their log lines.

A stranger can cause a refusal per connection, and a broken peer one per frame; told one
by one, a flood of them would fill the disk (``transport_events``) and the log. So per
event kind and peer host, the first :data:`PER_WINDOW` of each :data:`WINDOW` seconds are
told one by one, and the rest as one line and one event when the window ends ("1,204 more
corrupted frames from 10.0.0.7 in the last minute"). Many hosts at once (a botnet, or one
IPv6 attacker with a /64 of addresses to come from) are bounded too: an IPv6 host counts
as its /64, at most :data:`TOTAL_PER_WINDOW` events of a kind in a window are told one by
one whatever their source, and beyond :data:`MAX_SOURCES` sources of a kind the rest count
as one. Each kind has its own budget and sources, so keyless strangers, who cause only
rejected connections, cannot crowd out what a peer with the key did (a replayed or
corrupted frame on its connection, a refused message)."""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import logging
from collections.abc import Callable

log = logging.getLogger("scheduler_lib.broker.transport.endpoint")

PER_WINDOW = 10  # events told one by one per kind and peer host in each window
TOTAL_PER_WINDOW = 100  # events told one by one in each window, all sources together
WINDOW = 60.0  # seconds
MAX_SOURCES = 100  # (kind, host) pairs counted apart; beyond, counted together
WHAT = {
    "CONNECTION_REJECTED": "rejected connections",
    "CORRUPTED_MESSAGE": "corrupted frames",
    "MESSAGE_REJECTED": "refused messages",
    "REPLAYED_FRAME": "replayed frames",
}

Record = Callable[[float, str, str | None, str], None]  # (when, kind, peer, detail)


@dataclasses.dataclass
class _Window:
    started: float
    told: int = 0
    held: int = 0  # not told one by one: counted
    peer: str | None = None
    last: str = ""


def host_of(peer: str | None) -> str:
    """The source of a ``host:port`` peer: its host (a stranger reconnects from new
    ports), an IPv6 host's /64 (one site's, from which it can come from 2**64 addresses);
    a dialled ``tcp://`` address as it is."""
    if peer is None or peer.startswith("tcp://"):
        return peer or "?"
    host = peer.rsplit(":", 1)[0]
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return host


class Reports:
    """The endpoint's events and warnings, each source told at a bounded rate.

    :param record: keeps an event (the endpoint writes them in batches)
    """

    def __init__(self, record: Record) -> None:
        self._record = record
        self._windows: dict[tuple[str, str], _Window] = {}
        self._sources: collections.Counter[str] = collections.Counter()  # windows per kind
        self._budgets: dict[str, _Window] = {}  # per kind, all its sources together

    def report(
        self, now: float, kind: str, peer: str | None, detail: str, line: str | None
    ) -> None:
        """An event of ``kind`` from ``peer``, with its log line (``None``: event only)."""
        key = (kind, host_of(peer))
        if key not in self._windows and self._sources[kind] >= MAX_SOURCES:
            key = (kind, "*")  # so many hosts at once: one count for all of them
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = _Window(started=now)
            self._sources[kind] += 1
        budget = self._budgets.get(kind)
        if budget is None or now - budget.started >= WINDOW:
            budget = self._budgets[kind] = _Window(started=now)
        if window.told < PER_WINDOW and budget.told < TOTAL_PER_WINDOW:
            window.told += 1
            budget.told += 1
            if line is not None:
                log.warning("%s", line)
            self._record(now, kind, peer, detail)
            return
        window.held += 1
        window.peer, window.last = peer, detail

    def flush(self, now: float, *, force: bool = False) -> None:
        """Tell the counts of the windows that have ended (all of them with ``force``)."""
        for key, window in list(self._windows.items()):
            if not force and now - window.started < WINDOW:
                continue
            del self._windows[key]
            kind, host = key
            self._sources[kind] -= 1
            if window.held:
                if host == "*":  # the last one's address would stand for all of them
                    host, window.peer = "other hosts", None
                what = WHAT.get(kind, kind)
                seconds = now - window.started
                text = (
                    f"{window.held:,} more {what} from {host} in the last {seconds:.0f} s, "
                    f"not recorded one by one (the last: {window.last})"
                )
                log.warning("transport: %s", text)
                self._record(now, kind, window.peer, text)
