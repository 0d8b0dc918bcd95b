"""When a load is done inside the step that asks for it: only once both the step
and the host tier's load rate are measured, and only where the copy takes at
most a share of a step."""

import pytest

pytest.importorskip("vllm")

from kvarena.integrations.vllm.pace import IDLE_S, KEPT, STEP_SHARE, LoadPace


def test_nothing_is_loaded_in_the_step_before_both_sides_are_measured():
    pace = LoadPace()
    assert not pace.in_step(1)
    pace.loaded(1 << 20, 1e-3)  # a rate, no step yet
    assert not pace.in_step(1)
    pace.stepped(0.0)
    assert not pace.in_step(1)  # one step is no interval
    pace.stepped(0.02)
    assert pace.step_s() == pytest.approx(0.02) and pace.in_step(1)


def test_a_load_is_in_the_step_where_its_copy_fits_the_steps_share():
    pace = LoadPace()
    for i in range(5):
        pace.stepped(i * 0.01)  # 10 ms steps
    pace.loaded(10 << 20, 0.01)  # 10 MiB in 10 ms
    rate = pace.rate()
    assert rate == pytest.approx((10 << 20) / 0.01)
    fits = int(STEP_SHARE * 0.01 * rate)
    assert pace.in_step(fits) and not pace.in_step(fits + 1024)


def test_idle_gaps_are_not_steps_and_medians_forget_old_measures():
    pace = LoadPace()
    pace.stepped(0.0)
    pace.stepped(IDLE_S + 5)  # the engine waited for work
    assert pace.step_s() is None
    for i in range(KEPT):
        pace.stepped(IDLE_S + 5 + (i + 1) * 0.5)  # slow steps
    for i in range(KEPT):
        pace.stepped(100 + i * 0.001)  # then fast ones only
    assert pace.step_s() == pytest.approx(0.001)
    pace.loaded(0, 1.0)  # nothing measured by an empty or instant load
    pace.loaded(100, 0.0)
    assert pace.rate() is None
