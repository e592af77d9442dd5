"""BodyBudget and one stream's Reservation of it: grown to the bytes received, all or nothing."""

from __future__ import annotations

import pytest

from extproc.transport.body_budget import BodyBudget, Reservation


def test_reservation_grows_to_the_total_and_returns_it_once() -> None:
    budget = BodyBudget(100)
    r = Reservation(budget)
    assert r.grow_to(30) and budget.used == 30
    assert r.grow_to(20) and budget.used == 30  # already held: nothing more taken
    assert r.grow_to(70) and budget.used == 70
    r.release()
    r.release()
    assert budget.used == 0 and r.held == 0


def test_a_refused_growth_releases_what_the_stream_held_and_spares_the_others() -> None:
    budget = BodyBudget(100)
    other, r = Reservation(budget), Reservation(budget)
    assert other.grow_to(60)
    assert r.grow_to(30)
    assert not r.grow_to(50)  # 60 + 50 > 100
    assert r.held == 0 and budget.used == 60


def test_without_a_budget_nothing_is_counted_or_refused() -> None:
    r = Reservation(None)
    assert r.grow_to(1 << 40)
    r.release()
    assert r.held == 0


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BodyBudget(0)
