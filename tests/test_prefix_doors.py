"""The prefix cache's doors: every bad value refused by a kvarena error before any
book changes (lookup counts included), and the keys a value means, exactly."""

import json

import numpy as np
import pytest
import torch
from test_prefix import make, run

from kvarena import InvalidValueError
from kvarena.prefix import CheckpointPolicy
from kvarena.prefix.keys import MAX_EXTRA_DEPTH, as_tokens


def books(pc):
    b = pc.cache.blocks
    return (
        pc.metrics.to_dict(),
        b.num_free,
        b.num_live,
        b.num_evictable,
        pc.cached_blocks,
        pc.images,
        pc.cache.slots.num_free,
    )


def nested(depth):
    v = "x"
    for _ in range(depth):
        v = [v]
    return v


BAD_EXTRA = [
    ("lora-ab", r"got str 'lora-ab'; pass \('lora-ab',\)"),
    (b"lora", "got bytes"),
    ({"a": 1}, "got dict"),
    (7, "got int"),
    ([nested(MAX_EXTRA_DEPTH + 1)], "nest deeper"),
    ([nested(50_000)], "nest deeper"),
    ([float("nan")], "JSON values"),
    ([object()], "JSON values"),
]


@pytest.mark.parametrize(("extra", "words"), BAD_EXTRA)
def test_bad_extra_keys_are_refused_and_count_nothing(extra, words):
    pc = make()
    run(pc, "warm", np.arange(40))
    before = books(pc)
    for call in (
        lambda: pc.lookup(np.arange(40), extra),
        lambda: pc.admit("r", np.arange(40), extra=extra),
    ):
        with pytest.raises(InvalidValueError, match=words):
            call()
        assert books(pc) == before


def test_a_string_extra_is_one_key_only_when_asked_as_one():
    pc = make()
    one = pc.keys(np.arange(8), extra=("lora-ab",))
    chars = pc.keys(np.arange(8), extra=list("lora-ab"))
    assert one != chars and one != pc.keys(np.arange(8))
    assert pc.keys(np.arange(8), extra=[nested(MAX_EXTRA_DEPTH - 1)])  # flat enough


@pytest.mark.parametrize(
    ("tokens", "words"),
    [
        (torch.arange(8, device="meta"), "meta device"),
        (torch.zeros(8, dtype=torch.bool), "integer token ids"),
        (torch.zeros(8, dtype=torch.complex64), "integer token ids"),
        (np.zeros((2, 4), dtype=np.int64), "1-D"),
        ([1.5, 2.0], "integer token ids"),
        ([-1, 2], "0..2\\*\\*62-1"),
        ([1 << 63], "token ids"),
    ],
)
def test_bad_tokens_are_refused_and_count_nothing(tokens, words):
    pc = make()
    run(pc, "warm", np.arange(40))
    before = books(pc)
    with pytest.raises(InvalidValueError, match=words):
        pc.lookup(tokens)
    with pytest.raises(InvalidValueError, match=words):
        pc.admit("r", tokens)
    assert books(pc) == before


def test_tokens_from_any_device_that_holds_values():
    assert as_tokens(torch.arange(5)).tolist() == [0, 1, 2, 3, 4]
    assert as_tokens(np.arange(3, dtype=np.uint16)).dtype == np.int64


def test_a_refused_admission_for_room_counts_no_lookup():
    pc = make(budget=16 * 1024, seqs=1)
    pc.admit("a", np.arange(8))
    before = books(pc)
    with pytest.raises(Exception, match=r"state|slot|block"):
        pc.admit("b", np.arange(8))  # one slot, held by "a"
    assert books(pc) == before
    pc.lookup(np.arange(8))
    assert pc.metrics.lookups == before[0]["lookups"] + 1


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("end:５１２", "unknown"),  # fullwidth digits: str.isdigit() says yes
        ("end:²", "unknown"),
        ("interval:٤٠٩٦", "unknown"),  # Arabic-Indic digits
        ("end:+512", "unknown"),
        ("end:0", "unknown"),
        ("end:16777217", "unknown"),
        ("", "use end"),
    ],
)
def test_policy_specs_take_ascii_digits_only(text, words):
    with pytest.raises(InvalidValueError, match=words):
        CheckpointPolicy.parse(text)


@pytest.mark.parametrize("field", ["end", "branch"])
@pytest.mark.parametrize("value", ["no", "", 0, 1, None, "False"])
def test_policy_flags_must_be_bools(field, value):
    with pytest.raises(InvalidValueError, match=f"{field} must be True or False"):
        CheckpointPolicy(**{field: value})


@pytest.mark.parametrize("policy", ["", "end", 0, False, [], {}])
def test_a_policy_that_is_not_a_policy_is_refused(policy):
    with pytest.raises(InvalidValueError, match="policy must be a CheckpointPolicy"):
        make(policy=policy)


def test_the_default_policy_is_taken_only_for_none():
    assert make(policy=None).policy == CheckpointPolicy()
    assert make(policy=CheckpointPolicy(end=False, branch=True)).policy.end is False
    json.dumps(make().metrics.to_dict())
