"""When a load is done inside the step that asks for it: only once what the rule
needs is measured; while other requests run, where the step's loads together
take at most a share of a step; while none does, where they take at most what
an asynchronous load has waited."""

import pytest

pytest.importorskip("vllm")

from kvarena.integrations.vllm.pace import IDLE_S, KEPT, STEP_SHARE, LoadPace, copy_line

MIB = 1 << 20


def steps(pace: LoadPace, n: int, every: float, start: float = 0.0) -> None:
    for i in range(n):
        pace.stepped(start + i * every, busy=True)


def test_nothing_is_loaded_in_the_step_before_the_rule_is_measured():
    pace = LoadPace()
    assert pace.fits(1, idle=False) is None and pace.fits(1, idle=True) is None
    pace.loaded(MIB, 1e-3)  # a copy time, no step yet
    assert pace.fits(1, idle=False) is None and pace.fits(1, idle=True) is None
    pace.stepped(0.0, busy=True)
    assert pace.fits(1, idle=False) is None  # one step is no interval
    pace.stepped(0.02, busy=True)
    assert pace.step_s() == pytest.approx(0.02) and pace.fits(1, idle=False) is not None


def test_while_others_run_a_steps_loads_together_fit_its_share():
    pace = LoadPace()
    steps(pace, 5, 0.01)  # 10 ms steps
    pace.loaded(10 * MIB, 0.01)  # 10 MiB in 10 ms: 1 GiB/s, one size (no fixed cost known)
    budget = STEP_SHARE * 0.01
    fits = int(budget / 0.01 * 10 * MIB)
    assert pace.fits(fits, idle=False) == pytest.approx(budget, rel=1e-6)
    assert pace.fits(fits + 1024, idle=False) is None
    half = pace.fits(fits // 2, idle=False)
    assert half is not None
    pace.spend(half)  # one load put in this step: a second half fits, a third not
    pace.spend(pace.fits(fits // 2, idle=False) or pytest.fail("the second half"))
    assert pace.fits(fits // 4, idle=False) is None
    pace.stepped(0.05, busy=True)  # the next step starts with its whole budget
    assert pace.fits(fits // 2, idle=False) is not None


def test_while_none_runs_loads_fit_what_the_asynchronous_way_waits():
    """An idle engine: no request decoding waits for the copy, and the arriving
    request would wait for the asynchronous way's whole wait; a load that
    copies in less is done in the step."""
    pace = LoadPace()
    steps(pace, 5, 0.01)
    pace.loaded(10 * MIB, 0.01)
    assert pace.fits(5 * MIB, idle=False) is None  # 5 ms > 1 ms of a 10 ms step
    assert pace.fits(5 * MIB, idle=True) is None  # no asynchronous wait measured yet
    for w in (0.03, 0.04, 0.05):
        pace.waited(w)
    assert pace.wait_s() == pytest.approx(0.04)
    assert pace.fits(5 * MIB, idle=True) == pytest.approx(0.005)
    assert pace.fits(41 * MIB, idle=True) is None  # 41 ms > the 40 ms wait
    pace.waited(0.0)  # nothing measured by a wait of nothing
    assert pace.wait_s() == pytest.approx(0.04)
    for w in (0.1, 0.2):  # the estimate follows what is measured next
        pace.waited(w)
    assert pace.wait_s() == pytest.approx(0.05)


def test_the_copy_time_is_a_fixed_cost_and_a_bandwidth():
    """Small loads are mostly fixed cost, large ones mostly bytes: the line fitted
    to both predicts either, and one load that met a slow moment moves it
    little."""
    fixed, bw = 0.5e-3, 2e9
    loads = [(n, fixed + n / bw) for n in (64 << 10, 128 << 10, MIB, 4 * MIB, 16 * MIB) * 3]
    a, b = copy_line(loads)
    assert a == pytest.approx(fixed, rel=1e-6) and b == pytest.approx(1 / bw, rel=1e-6)
    slow = [*loads, (MIB, 0.5)]
    a2, b2 = copy_line(slow)
    assert a2 == pytest.approx(fixed, rel=0.2) and b2 == pytest.approx(1 / bw, rel=1e-6)
    pace = LoadPace()
    for n, t in loads:
        pace.loaded(n, t)
    assert pace.copy_s(64 << 10) == pytest.approx(fixed + (64 << 10) / bw, rel=1e-6)
    assert pace.copy_s(32 * MIB) == pytest.approx(fixed + 32 * MIB / bw, rel=1e-6)
    # larger loads that are no slower: no negative bandwidth, the fixed cost alone
    assert copy_line([(1, 2.0), (2, 2.0), (3, 1.0)])[1] == 0.0


def test_idle_gaps_are_not_steps_and_estimates_forget_old_measures():
    pace = LoadPace()
    pace.stepped(0.0, busy=True)
    pace.stepped(IDLE_S + 5, busy=True)  # the engine waited for work
    assert pace.step_s() is None
    pace.stepped(IDLE_S + 5.2, busy=False)  # a step after the engine was idle: no interval
    assert pace.step_s() is None
    steps(pace, KEPT, 0.5, IDLE_S + 6)  # slow steps
    assert pace.step_s() == pytest.approx(0.5)
    steps(pace, KEPT + 1, 0.001, 100)  # then fast ones only: the estimate follows
    assert pace.step_s() == pytest.approx(0.001)
    pace.loaded(0, 1.0)  # nothing measured by an empty or instant load
    pace.loaded(100, 0.0)
    assert pace.copy_s(100) is None
    for _ in range(KEPT):
        pace.loaded(MIB, 1.0)
    for _ in range(KEPT):
        pace.loaded(MIB, 1e-3)
    assert pace.copy_s(MIB) == pytest.approx(1e-3)


def test_fetched_loads_land_in_what_the_steps_budget_leaves():
    """A step copies in fetched loads up to its share, less what its in-step loads
    took, at the landings' own measured cost; one a step until both are known."""
    pace = LoadPace()
    pace.landed(4 * MIB, 2e-3)
    assert pace.land_bytes(idle=False) == 0  # no step measured: the first lands alone
    pace2 = LoadPace()
    steps(pace2, 5, 0.02)
    assert pace2.land_bytes(idle=False) == 0  # no landing measured
    for n, s in ((MIB, 1.5e-3), (2 * MIB, 2.5e-3), (8 * MIB, 8.5e-3), (16 * MIB, 16.5e-3)):
        pace2.landed(n, s)  # 0.5 ms fixed, 1 ms per MiB
    budget = STEP_SHARE * 0.02  # 2 ms of a 20 ms step
    assert pace2.land_bytes(idle=False) == pytest.approx((budget - 0.5e-3) / 1e-3 * MIB, abs=2)
    pace2.spend(1e-3)  # an in-step load took half the step's share
    assert pace2.land_bytes(idle=False) == pytest.approx(0.5 * MIB, abs=2)
    pace2.spend(1e-3)
    assert pace2.land_bytes(idle=False) == 0  # spent: only the first load lands
    for w in (0.1, 0.1, 0.1):
        pace2.waited(w)  # an idle engine lands what the asynchronous way waits
    assert pace2.land_bytes(idle=True) == pytest.approx((0.1 - 2e-3 - 0.5e-3) / 1e-3 * MIB, abs=2)
    pace2.stepped(1.0, busy=True)  # a new step: its whole share again
    assert pace2.land_bytes(idle=False) == pytest.approx(1.5 * MIB, abs=2)
    free = LoadPace()
    steps(free, 5, 0.02)
    free.landed(MIB, 1e-3)
    free.landed(2 * MIB, 1e-3)  # no cost per byte measured: no bound
    assert free.land_bytes(idle=False) is None
