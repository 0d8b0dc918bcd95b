"""The lookup contract and the tier walk without a device cache (``kvarena.prefix.lookup``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvarena.errors import InvalidValueError
from kvarena.prefix import ImagesWalked, locate_in_tiers, resume_point
from kvarena.tiers import TierStack
from kvarena.tiers.host import HostTier
from kvarena.tiers.image import encode
from kvarena.tiers.names import ImageKind


@given(
    cand=st.integers(0, 40),
    has_state=st.booleans(),
    images=st.sets(st.integers(1, 40)),
)
def test_resume_boundary_is_the_largest_boundary_with_an_image(cand, has_state, images):
    got = resume_point(cand, has_state, lambda b: b in images)
    if not has_state:
        assert got == cand
    else:
        want = max([b for b in images if b <= cand], default=0)
        assert got == want  # exact: neither longer (no image there) nor shorter


KEYS = [bytes([i]) * 16 for i in range(1, 80)]
NS = b'{"model":"t"}'


def _stack(kv: set[int], state: set[int]) -> TierStack:
    stack = TierStack([HostTier(1 << 20, frame_bytes=512)])
    objects = [
        encode(
            kind=ImageKind.KV_BLOCK,
            namespace=NS,
            key=KEYS[i],
            start=i * 16,
            end=(i + 1) * 16,
            payload=None,
            payload_bytes=64,
        )
        for i in sorted(kv)
    ] + [
        encode(
            kind=ImageKind.STATE,
            namespace=NS,
            key=KEYS[b - 1],
            start=0,
            end=b * 16,
            payload=None,
            payload_bytes=64,
        )
        for b in sorted(state)
    ]
    stack.write_back(objects)
    return stack


@given(
    device=st.integers(0, 70),
    tier_kv=st.sets(st.integers(0, 78), max_size=60),
    tier_state=st.sets(st.integers(1, 79), max_size=20),
    device_images=st.sets(st.integers(1, 79), max_size=5),
    limit=st.integers(0, 79),
    window=st.integers(1, 9),
)
def test_the_tier_walk_finds_exactly_what_the_tiers_hold(
    device, tier_kv, tier_state, device_images, limit, window
):
    """The KV run extends through every block the device or a tier holds, stops at
    the first gap, and the deepest boundary up to it whose image a tier holds is
    found (none where the device holds one as deep)."""
    device = min(device, limit)
    stack = _stack(tier_kv, tier_state)
    on_device = set(KEYS[:device])
    finds = locate_in_tiers(
        stack,
        KEYS,
        kv_end=device,
        limit=limit,
        has_kv=True,
        has_state=True,
        device_kv=lambda key: key in on_device,
        device_image=lambda b: b in device_images,
        window=window,
    )
    end = device
    while end < limit and end in tier_kv:
        end += 1
    assert finds.kv_end == end
    assert set(finds.kv) == set(range(device, end)) and set(finds.kv.values()) <= {0}
    deepest = max((b for b in tier_state | device_images if 1 <= b <= end), default=None)
    want = {deepest} if deepest in tier_state and deepest not in device_images else set()
    assert set(finds.state) == want
    # the resume point: the deepest boundary an image is at, the tiers' or the device's
    got = resume_point(end, True, lambda b: b in finds.state or b in device_images)
    assert got == (deepest or 0)


def test_names_that_failed_their_checks_count_as_absent():
    stack = _stack({0, 1, 2, 3}, {2, 4})
    from kvarena.tiers.names import object_name

    finds = locate_in_tiers(
        stack,
        KEYS,
        kv_end=0,
        limit=10,
        has_kv=True,
        has_state=True,
        device_kv=lambda key: False,
        device_image=lambda b: False,
        skip=frozenset({object_name(ImageKind.KV_BLOCK, KEYS[2])}),
    )
    assert finds.kv_end == 2 and set(finds.state) == {2}


@given(start=st.integers(0, 12), held=st.integers(0, 16))
def test_levels_found_before_are_in_the_answer_and_not_copied_where_none_join(start, held):
    """A waiting request's last run (``below``: blocks under ``kv_end``) is part of
    the answer's levels; where the walk adds none it is the caller's own dict."""
    below = dict.fromkeys(range(start), 0)
    finds = _walk(_stack(set(range(held)), set()), KEYS, kv_end=start, limit=20, below=below)
    end = max(start, held)
    assert finds.kv_end == end and finds.kv == dict.fromkeys(range(end), 0)
    assert (finds.kv is below) == (end == start and start > 0)
    assert below == dict.fromkeys(range(start), 0)  # never changed


@pytest.mark.parametrize("below", [{4: 0}, {0: 0, 9: 1}, {-1: 0}])
def test_levels_found_before_past_the_run_are_refused(below):
    with pytest.raises(InvalidValueError, match=r"below holds blocks .*0\.\.3, are legal"):
        _walk(_stack(set(), set()), KEYS, kv_end=4, limit=8, below=below)


def _walk(
    stack, keys, *, limit, kv_end=0, has_state=False, window=4, known=0, walked=None, below=None
):
    """The tier walk, nothing on the device (a scheduler's)."""
    return locate_in_tiers(
        stack,
        keys,
        kv_end=kv_end,
        limit=limit,
        has_kv=True,
        has_state=has_state,
        device_kv=None,
        device_image=None,
        window=window,
        known=known,
        walked=walked,
        below=below,
    )


def _kv_walk(stack, keys, limit, window, known):
    """The tier walk over KV alone, with these windows."""
    return _walk(stack, keys, limit=limit, window=window, known=known)


class _Counted(list):
    """Keys that remember the deepest one asked for (what a chain would hash)."""

    deepest = -1

    def __getitem__(self, i):
        self.deepest = max(self.deepest, i)
        return super().__getitem__(i)


@given(
    held=st.integers(0, 78),
    known=st.integers(0, 79),
    window=st.sampled_from([1, 4, 32]),
    limit=st.integers(0, 79),
)
def test_windows_reach_the_keys_known_and_hash_little_past_a_miss(held, known, window, limit):
    """Blocks ``0..held-1`` in the tiers: the answer is the same whatever the
    windows; the first window reaches the keys had without hashing, the next
    starts over small, and no key is asked past the window that meets the
    miss."""
    keys = _Counted(KEYS)
    finds = _kv_walk(_stack(set(range(held)), set()), keys, limit, window, known)
    end = min(held, limit)
    assert finds.kv_end == end and set(finds.kv) == set(range(end))
    # the windows as specified: the first to max(known, window) blocks; past
    # the known keys starting over at `window`, else doubling from each
    # window's end; the last the one that misses
    full, size, stop, deepest = 0, window, max(known, window), -1
    stretched = known > window
    while full < limit:
        top = min(limit, stop)
        deepest = top - 1
        if end < top:
            break
        full, size, stretched = top, size if stretched else size * 2, False
        stop = full + size
    assert keys.deepest == deepest


@pytest.mark.parametrize(("window", "known"), [(0, 0), (-4, 0), (4, -1), (2.5, 0)])
def test_a_window_or_known_count_out_of_range_is_refused(window, known):
    from kvarena.errors import InvalidValueError

    with pytest.raises(InvalidValueError, match=r"window|known"):
        _kv_walk(_stack({0}, set()), KEYS, 4, window, known)


class _Asked:
    """A stack that records every name asked of it."""

    def __init__(self, stack: TierStack) -> None:
        self.stack = stack
        self.names: list[str] = []

    def locate(self, names):
        self.names.extend(names)
        return self.stack.locate(names)


def _state_walk(stack, kv_end, limit, walked=None):
    return _walk(stack, KEYS, kv_end=kv_end, limit=limit, has_state=True, walked=walked)


@given(
    tier_kv=st.sets(st.integers(0, 78), max_size=60),
    before=st.sets(st.integers(1, 79), max_size=6),
    joined=st.sets(st.integers(1, 79), max_size=4),
    start=st.integers(0, 40),
    limit=st.integers(0, 79),
)
def test_a_walk_remembered_answers_as_a_walk_from_scratch(tier_kv, before, joined, start, limit):
    """A walk of the state images handed what an earlier walk found (ImagesWalked)
    answers exactly as a walk from scratch, while the earlier walk still holds:
    images joined since only above its top, or at or below the image it found
    (a deeper run then walks only past the top); boundaries it covered are not
    asked again."""
    start = min(start, limit)
    first = _state_walk(_stack(tier_kv, before), start, limit)
    top, image = first.kv_end, max(first.state, default=0)
    walked = ImagesWalked(top=top, image=image, level=first.state.get(image))
    joined = {b for b in joined if b > top or b <= image}  # where the earlier walk still holds
    stack = _Asked(_stack(tier_kv, before | joined))
    again = _state_walk(stack, start, limit, walked)
    assert again == _state_walk(_stack(tier_kv, before | joined), start, limit)
    from kvarena.tiers.names import object_name

    covered = {object_name(ImageKind.STATE, KEYS[b - 1]) for b in range(1, top + 1)}
    assert not covered & set(stack.names)


def test_a_walk_remembered_is_refused_where_it_cannot_hold():
    stack = _stack(set(range(10)), {3})

    def walk(**kw):
        return locate_in_tiers(
            stack, KEYS, kv_end=0, limit=10, has_kv=True, has_state=True, device_kv=None, **kw
        )

    for bad, what in (
        (dict(walked=ImagesWalked(top=4, image=5, level=0), device_image=None), "boundary 5"),
        (dict(walked=ImagesWalked(top=4, image=2), device_image=None), "tier None"),
        (dict(walked=ImagesWalked(top=4, image=0, level=0), device_image=None), "tier 0"),
        (dict(walked=ImagesWalked(top=-1, image=0), device_image=None), "-1"),
        (dict(walked=ImagesWalked(top=4, image=0), device_image=lambda b: False), "device_image"),
    ):
        with pytest.raises(InvalidValueError, match=what):
            walk(**bad)
    assert set(walk(walked=ImagesWalked(top=4, image=3, level=0), device_image=None).state) == {3}
