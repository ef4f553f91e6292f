"""Which of a take's leases an executor runs now, holds, or gives back at once
(``Executor._hold_rest``): thin glue over the broker, with stand-ins for it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from scheduler_lib import cli
from scheduler_lib.broker import ConversationStateError, DatabaseError, InvalidArgument
from scheduler_lib.broker.leases import Lease
from scheduler_lib.scheduler.executor import Executor, prefetch_setting
from scheduler_lib.scheduler.prefetch import ONE_SCHEDULER, Prefetched


def _lease(lease_id: str, priority: int) -> Lease:
    return Lease(lease_id, SimpleNamespace(priority=priority), "w", 30.0, 0.0)  # type: ignore[arg-type]


class _Stand:
    """The executor's broker and prefetched leases: what was released and held."""

    def __init__(self, failing: bool = False) -> None:
        self.released: list[str] = []
        self.held: list[str] = []
        self.failing = failing
        self.broker = SimpleNamespace(release=self._release)
        self._prefetched = SimpleNamespace(hold=self._hold)

    def _release(self, lease: Lease) -> None:
        if self.failing:
            raise DatabaseError("the database is away")
        self.released.append(lease.lease_id)

    def _hold(self, leases: list[Lease]) -> None:
        self.held.extend(lease.lease_id for lease in leases)


def _choose(stand: _Stand, leases: list[Lease], recorded: frozenset[str]) -> Any:
    return Executor._hold_rest(stand, leases, recorded)  # type: ignore[arg-type]


def test_the_recorded_lease_runs_and_the_rest_is_held_in_order() -> None:
    stand = _Stand()
    leases = [_lease("a", 5), _lease("b", 5), _lease("c", 5)]
    assert _choose(stand, leases, frozenset({"b"})).lease_id == "b"
    assert (stand.held, stand.released) == (["a", "c"], [])


def test_without_a_recorded_lease_the_first_runs() -> None:
    stand = _Stand()
    leases = [_lease("a", 5), _lease("b", 5)]
    assert _choose(stand, leases, frozenset()).lease_id == "a"
    assert stand.held == ["b"]


def test_leases_below_the_first_ones_level_go_back_at_once() -> None:
    stand = _Stand()
    leases = [_lease("a", 9), _lease("b", 9), _lease("c", 1), _lease("d", 5)]
    assert _choose(stand, leases, frozenset({"a"})).lease_id == "a"
    assert (stand.held, stand.released) == (["b"], ["c", "d"])


def test_a_lower_lease_that_cannot_go_back_is_held_not_left_to_expire() -> None:
    stand = _Stand(failing=True)
    leases = [_lease("a", 9), _lease("c", 1)]
    assert _choose(stand, leases, frozenset({"a"})).lease_id == "a"
    assert (stand.held, stand.released) == (["c"], [])


@pytest.mark.parametrize(("text", "expected"), [("", 4), (" 2 ", 2), ("1", 1)])
def test_the_prefetch_setting_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, text: str, expected: int
) -> None:
    monkeypatch.setenv("SCHEDULER_LIB_EXECUTOR_PREFETCH", text)
    assert prefetch_setting() == expected


@pytest.mark.parametrize("text", ["0", "-3", "four", "2.5"])
def test_a_bad_prefetch_setting_is_named_in_one_line(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv("SCHEDULER_LIB_EXECUTOR_PREFETCH", text)
    with pytest.raises(InvalidArgument) as raised:
        prefetch_setting()
    said = str(raised.value)
    assert "SCHEDULER_LIB_EXECUTOR_PREFETCH" in said and repr(text) in said
    assert "\n" not in said


def test_serve_says_a_bad_prefetch_setting_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    monkeypatch.setenv("SCHEDULER_LIB_EXECUTOR_PREFETCH", "many")
    database = tmp_path / "broker.db"
    assert cli.main(["serve", "--db", f"sqlite:///{database}"]) == cli.EXIT_ERROR
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "scheduler-lib: error: SCHEDULER_LIB_EXECUTOR_PREFETCH='many': give a whole number "
        "of tasks, at least 1 (1: no prefetch)"
    ]
    assert out == "" and not database.exists()  # nothing started, nothing written


class _Renewing:
    """A broker stand-in for ``Prefetched``: which leases are renewed, what release does."""

    closed = False

    def __init__(self, release: Any) -> None:
        self.renewed: set[str] = set()
        self.release = release

    @contextlib.contextmanager
    def keep_alive(self, leases: list[Lease]) -> Iterator[dict[str, Any]]:
        self.renewed.update(lease.lease_id for lease in leases)
        try:
            yield {}
        finally:
            self.renewed.difference_update(lease.lease_id for lease in leases)


@pytest.mark.parametrize(
    ("error", "stays_held"),
    [
        (DatabaseError("the database is away"), True),
        (ConversationStateError("the conversation ended"), False),
        (RuntimeError("a bug"), False),
    ],
)
def test_a_lease_that_cannot_go_back_is_kept_only_while_the_database_is_away(
    error: Exception, stays_held: bool
) -> None:
    def release(lease: Lease) -> None:
        if lease.lease_id == "b":
            raise error

    broker = _Renewing(release)
    held = Prefetched(broker, "q")  # type: ignore[arg-type]
    held.hold([_lease("a", 5), _lease("b", 5), _lease("c", 5)])
    # When everything held goes back, and b's release fails
    assert held.give_back() == 2
    # Then a and c went back and are no longer renewed; b is held (and renewed) only
    # when the database was away, else left to its lease's expiry — never renewed for ever
    assert broker.renewed == ({"b"} if stays_held else set())
    assert (held.pop() is not None) is stays_held
    broker.closed = True  # its sweeper thread ends


def test_takes_that_serve_several_schedulers_in_turn_take_one_each() -> None:
    held = Prefetched(None, "q")  # type: ignore[arg-type]
    held.ran(0.001)  # the queue's tasks run short
    tops = []
    for group in ["a", "b", "a", "b", "a", "a", "a", "a", "b"]:
        held.took(group)
        tops.append(held.top(4))
    # Only after ONE_SCHEDULER takes in a row from one scheduler; one from another ends it
    assert ONE_SCHEDULER == 4
    assert tops == [1, 1, 1, 1, 1, 1, 1, 4, 1]
