"""A request's prefix keys: hashed as far as asked, equal to the whole chain's,
and the keys of partial blocks apart from every full block's and each other's."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")

from kvarena import InvalidValueError
from kvarena.integrations.vllm.chains import CHUNK, RequestKeys
from kvarena.prefix.keys import block_keys, tail_key
from kvarena.tiers.names import ImageKind, object_name

ROOT = b"r" * 16


def request(tokens):
    return SimpleNamespace(all_token_ids=list(tokens))


@given(
    tokens=st.lists(st.integers(0, 1 << 40), min_size=0, max_size=300),
    bs=st.sampled_from([1, 4, 16]),
    asked=st.lists(st.integers(0, 400), max_size=6),
    extra=st.sampled_from([(), ("lora-a",), ("lora-a", "salt")]),
)
def test_keys_asked_in_any_order_are_the_whole_chains(tokens, bs, asked, extra):
    chain = RequestKeys(ROOT, request(tokens), bs, extra)
    whole = block_keys(ROOT, np.asarray(tokens, dtype=np.int64), bs, extra)
    for i in asked:
        if i < len(whole):
            assert chain[i] == whole[i]
        else:
            with pytest.raises(IndexError):
                chain[i]
    assert chain.upto(len(whole)) == whole
    assert chain.names(ImageKind.STATE, 0, len(whole)) == [
        object_name(ImageKind.STATE, k) for k in whole
    ]


def test_a_lookup_hashes_only_the_blocks_it_asks_for():
    calls = []
    req = request(range(16 * 200))
    chain = RequestKeys(ROOT, req, 16, ())
    real = chain._tokens
    chain._tokens = lambda a, b: (calls.append((a, b)), real(a, b))[1]
    chain[0]
    assert calls == [(0, CHUNK * 16)]
    chain[CHUNK - 1]
    assert len(calls) == 1
    req.all_token_ids.extend(range(5))  # the request grows: nothing rehashed
    chain[CHUNK]
    assert calls[1] == (CHUNK * 16, 2 * CHUNK * 16)


def test_a_partial_blocks_key_is_its_own():
    tokens = list(range(100, 140))
    chain = RequestKeys(ROOT, request(tokens), 16, ())
    full = block_keys(ROOT, np.asarray(tokens, dtype=np.int64), 16)
    tails = {chain.tail(2, t) for t in range(1, 8)}
    assert len(tails) == 7 and not tails & set(full)
    assert chain.tail(2, 3) == tail_key(full[1], np.asarray(tokens[32:35]), 16)
    assert chain.tail(0, 3) == tail_key(ROOT, np.asarray(tokens[:3]), 16)
    other = RequestKeys(ROOT, request([*tokens[:33], 7, 7]), 16, ())
    assert other.tail(2, 1) == chain.tail(2, 1) and other.tail(2, 2) != chain.tail(2, 2)
    salted = RequestKeys(ROOT, request(tokens), 16, ("salt",))
    assert salted.tail(2, 3) != chain.tail(2, 3)
    for bad in (0, 16):
        with pytest.raises(InvalidValueError, match=r"partial block holds 1\.\.15"):
            tail_key(ROOT, np.arange(bad), 16)
