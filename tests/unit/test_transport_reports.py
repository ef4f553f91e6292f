"""The transport's events and log lines at a bounded rate (reports.Reports): per source,
all sources together, and an IPv6 site counted as one source."""

from __future__ import annotations

import logging
import re

import pytest

from scheduler_lib.broker.transport import reports

Row = tuple[float, str, str | None, str]


def told(events: list[Row]) -> int:
    """How many events the rows account for: one each, or the count a summary gives."""
    counted = 0
    for _, _, _, detail in events:
        more = re.match(r"([\d,]+) more ", detail)
        counted += int(more.group(1).replace(",", "")) if more else 1
    return counted


def test_a_crowd_of_hosts_is_told_within_one_budget(caplog: pytest.LogCaptureFixture) -> None:
    # Given an endpoint's reports, and 1,000 hosts each causing 20 rejections in a minute
    rows: list[Row] = []
    book = reports.Reports(lambda *event: rows.append(event))
    with caplog.at_level(logging.WARNING, logger=reports.log.name):
        for round_ in range(20):
            for host in range(1000):
                peer = f"10.0.{host // 256}.{host % 256}:{40000 + round_}"
                book.report(1.0 + round_, "CONNECTION_REJECTED", peer, "garbage", "a line")
        # When the minute ends
        book.flush(1.0 + reports.WINDOW, force=True)
    # Then a bounded number of rows and lines were written: the budget told one by one,
    # and a count per source followed (the sources beyond MAX_SOURCES counted together)
    limit = reports.TOTAL_PER_WINDOW + reports.MAX_SOURCES + 1  # one kind
    assert len(rows) <= limit
    assert len(caplog.records) <= limit
    # And every event is accounted for in them
    assert told(rows) == 20 * 1000
    others = [row for row in rows if "from other hosts" in row[3]]
    assert len(others) == 1 and others[0][2] is None  # no one address stands for them


def test_strangers_do_not_crowd_out_what_a_peer_with_the_key_did() -> None:
    # Given a minute in which 1,000 keyless hosts each had connections rejected
    rows: list[Row] = []
    book = reports.Reports(lambda *event: rows.append(event))
    for host in range(1000):
        for _ in range(5):
            book.report(1.0, "CONNECTION_REJECTED", f"10.1.{host // 256}.{host % 256}:1", "x", None)
    # When the peer's connection gets a replayed frame
    book.report(2.0, "REPLAYED_FRAME", "192.0.2.9:4022", "MESSAGE frame number 7", None)
    # Then that one is recorded one by one, with its peer
    assert rows[-1] == (2.0, "REPLAYED_FRAME", "192.0.2.9:4022", "MESSAGE frame number 7")


@pytest.mark.parametrize(
    ("peer", "source"),
    [
        ("2001:db8:1:2:aaaa:bbbb:cccc:dddd:4022", "2001:db8:1:2::/64"),
        ("[2001:db8:1:2::7]:4022", "2001:db8:1:2::/64"),
        ("::ffff:192.0.2.7:4022", "192.0.2.7"),
        ("192.0.2.7:4022", "192.0.2.7"),
        ("broker-b.example:4022", "broker-b.example"),
        ("tcp://broker-b.example:4022", "tcp://broker-b.example:4022"),
        (None, "?"),
    ],
)
def test_the_source_of_a_peer(peer: str | None, source: str) -> None:
    assert reports.host_of(peer) == source


def test_an_ipv6_site_is_one_source() -> None:
    # Given 500 addresses of one IPv6 /64, each causing one corrupted frame
    rows: list[Row] = []
    book = reports.Reports(lambda *event: rows.append(event))
    for n in range(500):
        book.report(1.0, "CORRUPTED_MESSAGE", f"2001:db8::{n:x}:4022", "bad hmac", "a line")
    book.flush(2.0, force=True)
    # Then they are told as one source: its first ones, then one count
    assert len(rows) == reports.PER_WINDOW + 1
    assert rows[-1][3].startswith(
        f"{500 - reports.PER_WINDOW} more corrupted frames from 2001:db8::/64"
    )
