"""The anti-replay window of a connection's frame numbers (frames.ReplayWindow)."""

from __future__ import annotations

import pytest

from scheduler_lib.broker.transport import frames


def test_numbers_in_order_are_accepted_once() -> None:
    window = frames.ReplayWindow()
    assert not window.accept(0)  # the CONFIRM's number, taken by the handshake
    assert [window.accept(n) for n in (1, 2, 3)] == [True, True, True]
    assert [window.accept(n) for n in (1, 2, 3)] == [False, False, False]


def test_a_reordered_number_inside_the_window_is_accepted_once() -> None:
    window = frames.ReplayWindow()
    assert window.accept(5)
    assert window.accept(3) and window.accept(4)
    assert not window.accept(3) and not window.accept(5)
    assert window.accept(2) and window.accept(1)


def test_a_number_older_than_the_window_is_refused() -> None:
    window = frames.ReplayWindow()
    assert window.accept(frames.REPLAY_WINDOW + 10)
    assert window.accept(11)  # exactly REPLAY_WINDOW - 1 below: still inside
    assert not window.accept(10)  # REPLAY_WINDOW below: outside
    assert not window.accept(1)


def test_a_jump_forgets_the_window_without_shifting_by_the_jump() -> None:
    window = frames.ReplayWindow()
    assert window.accept(10**30)  # a shift by 10**30 bits would never end
    assert not window.accept(10**30)
    assert window.accept(10**30 - 1)


@pytest.mark.parametrize("number", [None, -1, True, 1.0, "1", [1]])
def test_a_frame_without_a_proper_number_is_garbage(number: object) -> None:
    with pytest.raises(frames.GarbageFrame, match="frame number"):
        frames.ReplayWindow().accept(number)
