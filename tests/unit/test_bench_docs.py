"""The peers block of docs/benchmarks.md: replaced in place, inserted once after the intro.

Runs in the main virtualenv: bench.peers.report imports no peer (matplotlib only inside
``charts``).
"""

from __future__ import annotations

import pytest

from bench.peers import report

INTRO = "# Benchmarks\n\nIntro paragraph.\n"
OLD = "\n## broker_throughput — 2026-11-22\n\nold figures\n"


def block(text: str) -> str:
    return f"{report.BEGIN}\n{text}\n{report.END}\n"


def test_first_run_inserts_the_block_after_the_intro_before_older_sections() -> None:
    # Given a docs file without markers; When the block is written
    out = report.replace_block(INTRO + OLD, block("new"))
    # Then it sits between the intro and the first older section, which is untouched
    assert (
        out.index("Intro paragraph.") < out.index(report.BEGIN) < out.index("## broker_throughput")
    )
    assert out.endswith(OLD.lstrip("\n"))
    assert out.count(report.BEGIN) == 1


def test_a_later_run_replaces_only_what_is_between_the_markers() -> None:
    # Given a file with a block from an earlier run
    first = report.replace_block(INTRO + OLD, block("first run"))
    # When a new run writes its block
    second = report.replace_block(first, block("second run"))
    # Then the old block is gone, the new one is there once, the rest is unchanged
    assert "first run" not in second
    assert second.count("second run") == 1
    assert second.replace("second run", "first run") == first


def test_one_marker_without_the_other_is_an_error() -> None:
    with pytest.raises(ValueError, match="one peers marker"):
        report.replace_block(INTRO + report.BEGIN + OLD, block("x"))


def test_versus_says_ahead_or_behind_by_how_much() -> None:
    # throughput: higher is better; latency: lower is better
    assert report.versus(150.0, 100.0, True)[0] == "ahead by 50%"
    assert report.versus(50.0, 100.0, True)[0] == "behind by 2.00x (the peer is 2.00x better)"
    assert report.versus(5.0, 10.0, False)[0] == "ahead by 100%"
