import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvarena.pools import (
    EntryClass,
    PoolBudgetError,
    PoolKind,
    max_fitting_seqs,
    merge_classes,
    plan_pools,
)

PAGE, STATE = PoolKind.PAGE, PoolKind.STATE


def test_plan_by_hand():
    classes = [
        EntryClass(pool=PAGE, name="kv", entry_bytes=65536, block_size=16),
        EntryClass(
            pool=STATE, name="gdn", entry_bytes=1_000_000, entries_per_req=2, extra_entries=1
        ),
    ]
    plan = plan_pools(classes, 100_000_000, 10)
    assert plan.of("gdn").entries == 21 and plan.of("gdn").nbytes == 21_000_000
    assert plan.of("kv").entries == (100_000_000 - 21_000_000) // 65536 == 1205
    assert plan.token_capacity == 1205 * 16
    assert plan.max_num_seqs == 10 and not plan.clamped
    assert plan.unused_bytes == 100_000_000 - 21_000_000 - 1205 * 65536


def test_merge_adds_bytes_and_refuses_disagreement():
    a = EntryClass(pool=STATE, name="s", entry_bytes=100, entries_per_req=2)
    b = EntryClass(pool=STATE, name="s", entry_bytes=50, entries_per_req=2)
    assert merge_classes([a, b]) == [
        EntryClass(pool=STATE, name="s", entry_bytes=150, entries_per_req=2)
    ]
    with pytest.raises(ValueError, match="different entries_per_req: 2 vs 1"):
        merge_classes([a, EntryClass(pool=STATE, name="s", entry_bytes=50)])
    with pytest.raises(ValueError, match="different pool"):
        merge_classes(
            [
                EntryClass(pool=PAGE, name="s", entry_bytes=50),
                EntryClass(pool=STATE, name="s", entry_bytes=50),
            ]
        )
    # Different names stay separate counts even in one pool.
    assert len(merge_classes([a, EntryClass(pool=STATE, name="t", entry_bytes=50)])) == 2


def test_over_budget_carries_numbers_and_clamp_plans_at_the_fit():
    classes = [
        EntryClass(pool=PAGE, name="kv", entry_bytes=1000, block_size=16),
        EntryClass(pool=STATE, name="m", entry_bytes=10_000, extra_entries=2),
    ]
    with pytest.raises(PoolBudgetError) as info:
        plan_pools(classes, 95_000, 12)
    err = info.value
    assert (err.needed, err.available, err.entries, err.max_fitting_seqs) == (
        140_000,
        95_000,
        {"m": 14},
        7,
    )
    assert "max_num_seqs=7" in str(err)
    plan = plan_pools(classes, 95_000, 12, clamp=True)
    assert plan.max_num_seqs == 7 and plan.clamped and plan.of("m").entries == 9
    assert plan.of("kv").entries == 5
    with pytest.raises(PoolBudgetError):
        plan_pools(classes, 15_000, 4, clamp=True)  # not even one sequence fits


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"entry_bytes": 0}, "entry_bytes"),
        ({"entries_per_req": 0}, "entries_per_req"),
        ({"extra_entries": -1}, "extra_entries"),
        ({"name": ""}, "non-empty"),
        ({"pool": "state"}, "PoolKind"),
    ],
)
def test_entry_class_refusals(kwargs, match):
    args = {"pool": STATE, "name": "s", "entry_bytes": 10} | kwargs
    with pytest.raises(ValueError, match=match):
        EntryClass(**args)


def test_plan_refusals():
    with pytest.raises(ValueError, match="one PAGE class"):
        plan_pools(
            [
                EntryClass(pool=PAGE, name="a", entry_bytes=1),
                EntryClass(pool=PAGE, name="b", entry_bytes=1),
            ],
            100,
            1,
        )
    with pytest.raises(ValueError, match="max_num_seqs"):
        plan_pools([EntryClass(pool=PAGE, name="a", entry_bytes=1)], 100, 0)
    with pytest.raises(ValueError, match="STATE settings"):
        EntryClass(pool=PAGE, name="a", entry_bytes=1, entries_per_req=2)


@given(
    st.integers(1, 10_000),
    st.lists(
        st.tuples(st.integers(1, 5000), st.integers(1, 4), st.integers(0, 3)),
        min_size=1,
        max_size=3,
    ),
    st.integers(0, 2_000_000),
    st.integers(1, 300),
)
def test_plan_properties(page_bytes, states, budget, seqs):
    classes = [EntryClass(pool=PAGE, name="kv", entry_bytes=page_bytes, block_size=16)] + [
        EntryClass(pool=STATE, name=f"s{i}", entry_bytes=b, entries_per_req=e, extra_entries=x)
        for i, (b, e, x) in enumerate(states)
    ]
    fit = max_fitting_seqs(classes, budget)
    floor = lambda n: sum((n * e + x) * b for b, e, x in states)  # noqa: E731
    assert (floor(fit) <= budget or fit == 0) and floor(fit + 1) > budget
    try:
        plan = plan_pools(classes, budget, seqs)
    except PoolBudgetError as err:
        assert floor(seqs) > budget and err.max_fitting_seqs == fit
        return
    assert plan.used_bytes <= budget and plan.unused_bytes < page_bytes
    assert plan.of("kv").entries == (budget - floor(seqs)) // page_bytes


@pytest.mark.parametrize("budget", [-5, -1, 1.5, "1GiB", None, True])
def test_max_fitting_seqs_refuses_a_budget_that_is_not_a_byte_count(budget):
    from kvarena import InvalidValueError

    classes = [EntryClass(pool=STATE, name="s", entry_bytes=1024, entries_per_req=1)]
    with pytest.raises(InvalidValueError, match="budget_bytes"):
        max_fitting_seqs(classes, budget)
