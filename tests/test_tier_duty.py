"""Background work that keeps to a share of the time: a piece that took ``t``
is followed by a rest of ``t (1 / duty - 1)``. A fake clock: no test waits on a
real one."""

from __future__ import annotations

import pytest

from kvarena.errors import InvalidValueError
from kvarena.tiers import duty as module
from kvarena.tiers.duty import DutyCycle


def test_each_rest_is_what_the_piece_before_it_worked_scaled_to_the_duty(monkeypatch):
    clock, slept = [100.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s

    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(module.time, "sleep", sleep)
    for duty, rests in (
        (0.25, [0.006, 0.0015, 0.0]),
        (0.5, [0.002, 0.0005, 0.0]),
        (None, [0.0] * 3),
    ):
        slept.clear()
        cycle = DutyCycle(duty)
        for worked in (0.002, 0.0005, 0.0):
            clock[0] += worked
            cycle.rest()
        assert slept == pytest.approx(rests)  # None: the interpreter handed over only
    slept.clear()
    DutyCycle(1).rest()
    assert slept == [0.0]


@pytest.mark.parametrize("duty", [0, -0.5, 1.5, True, "0.25", float("nan")])
def test_a_duty_that_is_not_a_share_of_the_time_is_refused(duty):
    with pytest.raises(InvalidValueError, match="duty"):
        DutyCycle(duty)
