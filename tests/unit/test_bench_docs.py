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


def _dispatch(p50: float, p99: float) -> dict[str, float]:
    return {"samples": 1, "p50_ms": p50, "p90_ms": p50, "p99_ms": p99, "max_ms": p99}


def test_the_dispatch_goal_is_met_only_below_celery_and_every_postgresql_peer() -> None:
    peers = {"celery": _dispatch(4.0, 8.0), "pgqueuer": _dispatch(6.0, 15.0)}
    # ours at Celery's p50 and p99, below pgqueuer's: met
    met = report.dispatch_table({"systems": {"ours": _dispatch(4.0, 8.0), **peers}})
    assert met[-1].endswith("**met**.")
    # ours below Celery's p50 but over its p99: missed
    missed = report.dispatch_table({"systems": {"ours": _dispatch(3.0, 9.0), **peers}})
    assert missed[-1].endswith("**missed**.")


def test_the_dispatch_floors_are_no_peers_and_each_system_is_read_against_its_server() -> None:
    # Given floors far below every system (the least a dispatch does, no system's code)
    systems = {
        "ours": _dispatch(4.0, 8.0),
        "celery": _dispatch(4.0, 8.0),
        "pgqueuer": _dispatch(6.0, 15.0),
        "raw": _dispatch(1.5, 2.0),
        "raw_redis": _dispatch(0.5, 1.0),
    }
    lines = report.dispatch_table({"systems": systems})
    # Then the verdict compares ours with the peers only: met, though the floors are lower
    assert lines[-1].endswith("**met**.")
    # and the floors are named as such, each system measured from its own server's
    assert any("(floor)" in line and line.startswith("| raw PostgreSQL") for line in lines)
    assert (
        "- p50 above the PostgreSQL floor (1.50 ms), ms: scheduler_lib (ours) +2.50, "
        "pgqueuer +4.50." in lines
    )
    assert "- p50 above the Redis floor (0.50 ms), ms: Celery (Redis), prefetch 1 +3.50." in lines


def _spread(median: float) -> dict[str, float]:
    return {"median": median, "min": median, "max": median}


def test_the_waves_goal_is_a_makespan_at_most_08_of_the_best_peers() -> None:
    def table(ours: float) -> list[str]:
        systems = {
            s: {"makespan_s": _spread(v), "sync_overhead_ms": _spread(1.0)}
            for s, v in (("ours", ours), ("celery", 1.0), ("procrastinate", 1.2))
        }
        return report.waves_table({"systems": systems})

    assert table(0.8)[-1].endswith("0.80 x: **met**.")
    assert table(0.81)[-1].endswith("0.81 x: **missed**.")


def test_lazy_start_is_ours_not_a_peer_and_gets_its_own_verdict() -> None:
    peers = {"celery": _dispatch(4.0, 8.0), "pgqueuer": _dispatch(6.0, 15.0)}
    systems = {"ours": _dispatch(5.0, 9.0), "ours_lazy": _dispatch(3.5, 7.5), **peers}
    lines = report.dispatch_table({"systems": systems})
    goals = [line for line in lines if "goal (issue 24)" in line]
    # ours (durable) misses, ours with lazy start meets: each against the peers alone
    assert [g.rsplit(": ", 1)[1] for g in goals] == ["**missed**.", "**met**."]
    assert not any("vs the best peer (scheduler_lib" in line for line in lines)
    assert any(line.startswith("- p50: ours with lazy start ahead") for line in lines)


def test_a_share_just_below_the_queue_goal_is_not_shown_as_the_goal() -> None:
    # 731 / 1220 is 0.599: "0.60" beside a missed goal would read as met
    assert report.share_text(731 / 1220) == "0.599"
    assert report.share_text(0.6) == "0.60"
    assert report.share_text(0.46) == "0.46"
