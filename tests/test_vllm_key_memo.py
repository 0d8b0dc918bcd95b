"""kvarena's keys recalled by vLLM's block hashes (``integrations.vllm.key_memo``).

Requests are vLLM's own (``Request`` with the engine's sha256 block hasher);
every key and name a request holds, recalled or hashed, must be the whole
chain's over its tokens, for prompts sharing prefixes in any order, with
LoRA names and salts, with vLLM hashing finer than a block, and after the
memo forgets what its bound leaves no room for.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvarena.integrations.vllm.chains import RequestKeys, request_extra
from kvarena.integrations.vllm.key_memo import KeyMemo, trusted_hashes
from kvarena.prefix.keys import block_keys
from kvarena.tiers.names import ImageKind, object_name

ROOT = b"k" * 16
BS = 4


def vllm_request(rid, tokens, hash_bs=BS, salt=None):
    init_none_hash(sha256)
    return Request(
        rid,
        list(tokens),
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(hash_bs, sha256),
    )


def whole(tokens, extra=()):
    return block_keys(ROOT, np.asarray(tokens, dtype=np.int64), BS, extra)


prompts = st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(0, 50), max_size=30)),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(prompts=prompts, every=st.sampled_from([1, 2, 4]), kept=st.sampled_from([4, 1 << 17]))
def test_recalled_keys_and_names_are_the_whole_chains(prompts, every, kept):
    """Prompts built from one of four shared stems and a tail of their own,
    keyed one after another through one memo (vLLM hashing every ``BS // every``
    tokens; a memo bound of 4 keys forgets nearly everything): each request's
    keys and KV names are its whole chain's, asked in windows as a lookup asks."""
    stems = [list(range(100 * s, 100 * s + 20)) for s in range(4)]
    memo = KeyMemo(every, kept=kept)
    for n, (stem, tail) in enumerate(prompts):
        tokens = stems[stem] + tail
        req = vllm_request(f"r{n}", tokens, hash_bs=BS // every)
        keys = RequestKeys(ROOT, req, BS, request_extra(req), memo)
        want = whole(tokens)
        known = keys.known(len(want))
        assert 0 <= known <= len(want)
        for stop in sorted({min(len(want), s) for s in (known, known + 1, known + 3, len(want))}):
            assert keys.upto(stop) == want[:stop]
            assert keys.names(ImageKind.KV_BLOCK, 0, stop) == [
                object_name(ImageKind.KV_BLOCK, k) for k in want[:stop]
            ]


def test_a_shared_prefix_is_recalled_not_hashed_and_extras_keep_their_own_keys():
    memo = trusted_hashes("sha256", BS, BS)
    assert memo is not None
    stem = list(range(40))
    first = RequestKeys(ROOT, vllm_request("a", [*stem, 1, 2, 3, 4]), BS, (), memo)
    assert first.known(11) == 0
    assert first.upto(11) == whole([*stem, 1, 2, 3, 4])
    second_req = vllm_request("b", [*stem, 9, 9, 9, 9])
    second = RequestKeys(ROOT, second_req, BS, (), memo)
    hashed = []
    real = second._tokens
    second._tokens = lambda a, b: (hashed.append((a, b)), real(a, b))[1]
    assert second.known(11) == 10  # the stem's ten blocks, from the first request's chain
    assert second.upto(11) == whole([*stem, 9, 9, 9, 9])
    assert hashed == [(40, 44)]  # only the block past the stem
    salted_req = vllm_request("c", [*stem, 1, 2, 3, 4], salt="tenant-b")
    salted = RequestKeys(ROOT, salted_req, BS, request_extra(salted_req), memo)
    assert salted.known(11) == 0  # another salt: vLLM's hashes and kvarena's keys differ
    assert salted.upto(11) == whole([*stem, 1, 2, 3, 4], ("tenant-b",))
    lora = RequestKeys(ROOT, vllm_request("d", [*stem, 1, 2, 3, 4]), BS, ("lora-x",), memo)
    assert lora.known(11) == 0  # another set of extra keys: a table of its own
    assert lora.upto(11) == whole([*stem, 1, 2, 3, 4], ("lora-x",))


def test_a_recall_that_found_no_more_is_asked_again_once_the_memo_learns_or_vllm_hashes():
    """A waiting request asks the memo step after step: where it found nothing
    deeper, it is not asked again (no bisection) until the memo has learnt a
    chain or vLLM has hashed more of the request; then the deeper keys are had."""
    memo = KeyMemo(1)
    stem = list(range(40))
    waiting_req = vllm_request("w", [*stem, 5, 6, 7, 8, 1])
    waiting = RequestKeys(ROOT, waiting_req, BS, (), memo)
    asked = []
    real = memo.recall
    mine = waiting_req.block_hashes  # the waiting request's asks counted alone
    memo.recall = lambda *a: (asked.extend([a] if a[1] is mine else []), real(*a))[1]  # type: ignore[method-assign]
    assert waiting.known(11) == 0 and waiting.known(11) == 0 and waiting.known(5) == 0
    assert len(asked) == 1  # found nothing, nothing learnt since: not asked again
    # another request keys the stem: the memo learns, the waiting request recalls it
    RequestKeys(ROOT, vllm_request("o", [*stem, 9, 9, 9, 9]), BS, (), memo).upto(11)
    assert waiting.known(11) == 10 and len(asked) == 2
    assert waiting.upto(11) == whole([*stem, 5, 6, 7, 8])
    # vLLM hashes more of it (it decodes): asked again, though the memo learnt nothing
    grown_req = vllm_request("g", [*stem, 5, 6, 7])
    grown = RequestKeys(ROOT, grown_req, BS, (), memo)
    longer = RequestKeys(ROOT, vllm_request("l", [*stem, 5, 6, 7, 8, 3, 3, 3, 3]), BS, (), memo)
    longer.upto(12)  # learnt the chain through block 11
    before = memo.learnt
    assert grown.known(12) == 10 and len(grown_req.block_hashes) == 10
    grown_req.append_output_token_ids([8, 3, 3, 3, 3])  # vLLM hashes blocks 10 and 11
    assert memo.learnt == before and len(grown_req.block_hashes) == 12
    assert grown.known(12) == 12
    assert grown.upto(12) == whole([*stem, 5, 6, 7, 8, 3, 3, 3, 3])


@pytest.mark.parametrize(
    ("algo", "hash_bs", "bs", "every"),
    [
        ("sha256", 16, 16, 1),
        ("sha256_cbor", 8, 16, 2),
        ("xxhash", 16, 16, None),  # not cryptographic: a collision would load another prefix
        ("builtin", 16, 16, None),
        ("sha256", 12, 16, None),  # vLLM's hashes do not end every block
    ],
)
def test_only_cryptographic_hashes_ending_every_block_stand_for_keys(algo, hash_bs, bs, every):
    memo = trusted_hashes(algo, hash_bs, bs)
    assert (memo.every if memo is not None else None) == every


def test_the_bound_forgets_the_chains_learnt_first():
    memo = KeyMemo(1, kept=12)
    reqs = [vllm_request(f"r{i}", range(100 * i, 100 * i + 40)) for i in range(3)]
    for r in reqs:
        RequestKeys(ROOT, r, BS, (), memo).upto(10)
    again = [RequestKeys(ROOT, r, BS, (), memo) for r in reqs]
    assert [k.known(10) for k in again] == [0, 0, 10]  # 30 keys learnt, room for 12
    assert again[0].upto(10) == whole(list(range(40)))
