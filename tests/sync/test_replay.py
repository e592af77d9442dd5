"""The replay window (extproc/sync/replay.py)."""

from __future__ import annotations

from extproc.sync.replay import ReplayGuard


def guard(**kw: float) -> ReplayGuard:
    return ReplayGuard(**{"window": 8, "max_origins": 4, "forget_after_s": 100.0, **kw})  # type: ignore[arg-type]


def test_each_seq_is_accepted_once_in_any_order_within_the_window() -> None:
    g = guard()
    assert [g.accept(1, s, 0) for s in (5, 3, 4, 5, 3, 9, 2, 2)] == [True, True, True, False, False, True, True, False]
    assert not g.accept(1, 1, 0)  # 9 - 1 = 8: below the window, too old to tell
    assert g.accept(2, 1, 0)  # another origin has its own window
    assert not g.accept(1, 0, 0)


def test_a_jump_past_the_window_forgets_the_old_bits() -> None:
    g = guard()
    assert g.accept(1, 1, 0) and g.accept(1, 100, 0)
    assert g.accept(1, 99, 0) and not g.accept(1, 100, 0) and not g.accept(1, 1, 0)


def test_origins_are_bounded_and_stale_ones_forgotten() -> None:
    g = guard()
    for origin in range(6):
        assert g.accept(origin, 1, 0)
    assert len(g) == 4 and g.evicted == 2
    assert g.accept(9, 1, 150)  # the others were last heard 150 s ago (> 100): forgotten, not evicted
    assert len(g) == 1 and g.evicted == 2
