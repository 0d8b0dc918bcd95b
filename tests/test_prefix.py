"""The prefix cache's lookup contract, its edge cases, and a model-based random test."""

import math
import random

import numpy as np
import pytest
import torch
from conftest import plan_for

from kvarena import EntryField, ServingOptions, model_cache, plan_cache
from kvarena.prefix import CheckpointPolicy, ImageState, PrefixCache, key_root, plan_namespace
from kvarena.prefix.keys import block_keys

PAGE = [EntryField("k", 2, (4, 8), torch.bfloat16)]
STATE = [
    EntryField("ssm", 2, (2, 16), torch.float32),
    EntryField("score", 1, (8,), torch.float32, fill=-math.inf, in_checkpoint=False),
]
BS = 4  # tokens per block


def make(budget=64 * 1024, seqs=4, **kw) -> PrefixCache:
    return PrefixCache(plan_for(PAGE, STATE, budget, seqs, block_size=BS), "cpu", **kw)


def run(pc: PrefixCache, request, tokens, *, state_word=None):
    """Admit, 'compute' (write the state, keep the policy's images), commit."""
    adm = pc.admit(request, tokens)
    for b in adm.checkpoints:
        pc.cache.state_view("ssm")[:, adm.slots[0]].fill_(
            float(b if state_word is None else state_word)
        )
        pc.checkpoint(request, b)
    pc.commit(request, len(tokens))
    return adm


def test_keys_are_chained_and_namespaced():
    tokens = np.arange(12)
    pc = make()
    keys = pc.keys(tokens)
    assert len(keys) == 3 and len(set(keys)) == 3
    # A block's key depends on every block before it.
    other = pc.keys(np.concatenate([[99], tokens[1:]]))
    assert all(a != b for a, b in zip(keys, other, strict=True))
    assert pc.keys(tokens, extra=["lora-a"]) != keys
    # Another layout (dtype), block size or rank is another namespace: no key matches.
    plan = pc.cache.plan
    ns = plan_namespace(plan)
    assert plan_namespace(plan, tp_rank=0).digest == ns.digest == key_root(ns.to_json())
    state16 = [EntryField("ssm", 2, (2, 16), torch.float16), STATE[1]]
    other_plan = plan_for(PAGE, state16, 64 * 1024, 4, block_size=BS)
    assert plan_namespace(other_plan).digest != ns.digest
    assert block_keys(plan_namespace(other_plan).digest, tokens, BS) != keys


def test_a_key_is_the_documented_hash_whichever_road_made_it():
    """Names in a tier outlive a release: a block's key stays BLAKE2b-128 of its
    parent, its tokens as int64 and its extra keys' JSON, whether made from an
    array (:func:`block_keys`) or from a request's list (a scheduler's road)."""
    import hashlib
    import json

    from kvarena.prefix.keys import chained_keys, extra_bytes, token_bytes

    root, tokens, extra = b"r" * 16, [5, 1 << 40, 0, 7, 9, 3, 2, 8, 1], ["lora-a", "s"]
    salt = json.dumps(extra, sort_keys=True, separators=(",", ":")).encode()
    want, parent = [], root
    for i in range(2):  # two full blocks of 4; the ninth token has no key
        block = np.asarray(tokens[i * 4 : i * 4 + 4], dtype="<i8").tobytes()
        parent = hashlib.blake2b(parent + block + salt, digest_size=16).digest()
        want.append(parent)
    assert block_keys(root, np.asarray(tokens, dtype=np.int64), 4, extra) == want
    assert token_bytes(tokens[:8]) == np.asarray(tokens[:8], dtype=np.int64).tobytes()
    assert chained_keys(root, token_bytes(tokens[:8]), 4, extra_bytes(extra)) == want
    assert chained_keys(want[0], token_bytes(tokens[4:8]), 4, extra_bytes(extra)) == want[1:]
    alone = hashlib.blake2b(root + token_bytes(tokens[:4]), digest_size=16).digest()
    assert extra_bytes(()) == b"" and block_keys(root, np.asarray(tokens[:4]), 4) == [alone]


def test_block_keys_key_any_integer_ids_as_int64_and_refuse_the_rest():
    from kvarena import InvalidValueError

    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    want = block_keys(b"r" * 16, np.asarray(ids, dtype=np.int64), 4)
    for same in (ids, np.asarray(ids, dtype=np.int32), np.asarray(ids, dtype=np.uint16)):
        assert block_keys(b"r" * 16, same, 4) == want
    assert block_keys(b"r" * 16, torch.tensor(ids, dtype=torch.int32), 4) == want
    with pytest.raises(InvalidValueError, match="integer token ids"):
        block_keys(b"r" * 16, np.asarray(ids, dtype=np.float32), 4)
    with pytest.raises(InvalidValueError, match="block_size"):
        block_keys(b"r" * 16, ids, 0)


def test_hit_needs_kv_and_an_image_at_exactly_that_boundary():
    pc = make(policy=CheckpointPolicy(end=True, branch=False, learn=False))
    a = np.arange(40)
    run(pc, "a", a)  # image at its end: 10 blocks
    pc.finish("a")
    # The same prompt again: at most len - 1 tokens, so the image at 40 cannot serve;
    # the KV matches 9 blocks but no image lies at 36: the answer is 0, not 36.
    hit = pc.lookup(a)
    assert (hit.tokens, hit.matched_kv_tokens, hit.lost_tokens) == (0, 36, 36)
    # A longer prompt resumes exactly at the image.
    longer = np.concatenate([a, [7, 7, 7]])
    hit = pc.lookup(longer)
    assert hit.tokens == 40 and hit.image is not None and len(hit.blocks) == 10
    adm = pc.admit("b", longer)
    # The restored state is the one taken at that boundary, in the new request's own slot.
    assert torch.all(pc.cache.state_view("ssm")[:, adm.slots[0]] == 10.0)
    assert torch.all(pc.cache.state_view("score")[:, adm.slots[0]] == -math.inf)


def test_a_hit_shorter_than_one_block_and_a_hit_at_the_first_block():
    for policy, expect in (
        (CheckpointPolicy(end=True, branch=False, learn=False), 0),
        (CheckpointPolicy(interval_tokens=4), 4),
    ):
        pc = make(policy=policy)
        assert pc.lookup(np.arange(3)).tokens == 0  # no full block, nothing to hit
        run(pc, "a", np.arange(8))
        pc.finish("a")
        assert pc.lookup(np.arange(3)).tokens == 0
        # 5 tokens: at most 4 can hit, and only with an image kept at block 1.
        hit = pc.lookup(np.arange(5))
        assert (hit.tokens, hit.matched_kv_tokens) == (expect, 4)


def test_branch_points_serve_a_shared_system_prompt():
    # Each request: the same 24-token system prompt, then its own question.
    def prompt(i):
        return np.concatenate([np.arange(24), 1000 * (i + 1) + np.arange(10)])

    hits = {}
    for policy in (
        CheckpointPolicy(end=True, branch=False, learn=False),
        CheckpointPolicy(end=True, branch=True, learn=False),
    ):
        pc = make(policy=policy)
        got = []
        for i in range(5):
            adm = run(pc, i, prompt(i))
            got.append(adm.hit.tokens)
            pc.finish(i)
        hits[policy.branch] = got
    # End-only never hits (each image lies past the shared part), as vLLM's align mode;
    # with branch points the second request keeps an image at 24 and the rest hit it.
    assert hits[False] == [0, 0, 0, 0, 0]
    assert hits[True] == [0, 0, 24, 24, 24]


def _brute_force_hit(pc, keys, limit):
    """The longest boundary b <= limit with blocks 0..b-1 cached and an image at b,
    found by trying every boundary (no shortcut shared with the cache)."""
    from kvarena.prefix import image_key

    pool = pc.cache.blocks
    best = 0
    for b in range(1, limit + 1):
        kv = all(pool.blocks_of(keys[i]) is not None for i in range(b))
        image = pool.blocks_of(image_key(keys[b - 1])) is not None
        if kv and image:
            best = b
    return best


def test_a_copying_image_is_not_visible():
    pc = make()
    a = np.arange(16)
    adm = pc.admit("a", a)
    pc.cache.state_view("ssm")[:, adm.slots[0]].fill_(3.0)

    class Event:  # a copy on the caller's stream, not yet complete
        done = False

        def query(self):
            return self.done

    event = Event()
    img = pc.checkpoint("a", 4, event=event)
    pc.commit("a", 16)
    pc.finish("a")
    longer = np.arange(20)
    assert pc.lookup(longer).tokens == 0  # the bytes are not known written yet
    assert img.state is ImageState.COPYING
    event.done = True
    assert pc.lookup(longer).tokens == 16
    assert img.state is ImageState.READY


def test_an_image_evicted_between_lookup_and_admission_is_never_half_restored():
    pc = make()
    run(pc, "a", np.arange(16))
    pc.finish("a")
    longer = np.arange(20)
    hit = pc.lookup(longer)
    assert hit.tokens == 16 and hit.image is not None
    # Memory pressure evicts the image (LRU) before the request is admitted.
    for u in hit.image.units:
        if pc.cache.blocks.is_evictable(u):
            pc.cache.blocks.evict(u)
            break
    assert pc.metrics.evicted_images == 1
    adm = pc.admit("b", longer)
    assert adm.hit.tokens == 0 and adm.hit.image is None and adm.hit.lost_tokens == 16
    pc.check_books()


def test_running_blocks_and_images_are_never_evicted_and_moves_are_followed():
    pc = make(budget=40 * 1024)
    a = np.arange(32)
    adm = run(pc, "a", a)
    held = set(adm.blocks) | {u for img in adm.images for u in img.units}
    # Fill the rest of the pool with other requests' cached blocks, then squeeze it.
    for i in range(6):
        try:
            run(pc, f"x{i}", 10_000 * (i + 1) + np.arange(24))
            pc.finish(f"x{i}")
        except RuntimeError:
            break
    assert all(not pc.cache.blocks.is_free(b) for b in held)
    move = pc.cache.grow_state(2)  # evicts and relocates through the prefix cache's books
    pc.check_books()
    remapped = [move.block_remap.get(b, b) for b in adm.blocks]
    assert pc.running("a").blocks == remapped
    pc.finish("a")
    hit = pc.lookup(np.arange(40))
    assert hit.tokens == 32 and list(hit.blocks) == remapped


def test_refusals_take_nothing():
    pc = make(budget=16 * 1024, seqs=1)
    before = (pc.cache.blocks.num_free, pc.cache.slots.num_free)
    with pytest.raises(RuntimeError, match="blocks"):
        pc.admit("huge", np.arange(10_000))
    assert (pc.cache.blocks.num_free, pc.cache.slots.num_free) == before
    for bad in ([1.5, 2.0], ["a"], np.zeros((2, 2), dtype=np.int64), [-1]):
        with pytest.raises(ValueError):
            pc.admit("r", bad)
    for request in (None, ["r"]):  # "no owner", unhashable: refused before any block is taken
        with pytest.raises(ValueError, match="request id"):
            pc.admit(request, np.arange(8))
    assert (pc.cache.blocks.num_free, pc.cache.slots.num_free) == before
    with pytest.raises(ValueError, match="interval"):
        PrefixCache(
            plan_for(PAGE, STATE, 64 * 1024, 4, block_size=BS),
            "cpu",
            policy=CheckpointPolicy(interval_tokens=6),
        )
    with pytest.raises(ValueError, match="unknown"):
        CheckpointPolicy.parse("end,sometimes")
    assert (
        CheckpointPolicy.parse("end:512,interval:64,branch").describe()
        == "end:512,interval:64,branch"
    )


def test_model_based_random_prompts_against_a_reference():
    """Random prompts sharing random prefixes, random evictions and boundary moves:
    every hit satisfies the contract (checked against a reference that knows every
    block and image ever kept), every restored state equals the state taken at that
    boundary, references return to zero and nothing leaks."""
    rng = random.Random(11)
    pc = make(
        budget=96 * 1024, seqs=3, policy=CheckpointPolicy(end=True, interval_tokens=8, branch=True)
    )
    stems = [list(rng.randrange(50) for _ in range(rng.randint(0, 30))) for _ in range(6)]
    for step in range(400):
        tokens = np.array(
            rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randint(1, 20))]
        )
        keys = pc.keys(tokens)
        limit = min(len(keys), (len(tokens) - 1) // BS)
        want = _brute_force_hit(pc, keys, limit)  # asked before the admission changes anything
        try:
            adm = pc.admit(step, tokens)
        except RuntimeError:
            continue
        h = adm.hit.tokens // BS
        # The contract, against a brute force over the pool's book: every hit block
        # cached under its key, an image exactly at h, and nothing longer would have
        # worked (so under-reporting fails as surely as over-reporting).
        assert h == want and adm.hit.tokens <= len(tokens) - 1
        if h:
            assert torch.all(
                pc.cache.state_view("ssm")[:, adm.slots[0]]
                == float(int.from_bytes(keys[h - 1][:2], "little"))
            )
        for b in adm.checkpoints:
            word = float(int.from_bytes(keys[b - 1][:2], "little"))
            pc.cache.state_view("ssm")[:, adm.slots[0]].fill_(word)
            pc.checkpoint(step, b)
        pc.commit(step, len(tokens))
        pc.finish(step)
        if rng.random() < 0.1:
            pc.cache.rebalance(waiting_requests=rng.randint(0, 3), blocks_needed=rng.randint(0, 20))
        if rng.random() < 0.1 and pc.cache.blocks.evictable_blocks():
            pc.cache.blocks.evict(rng.choice(pc.cache.blocks.evictable_blocks()))
        pc.check_books()
    b = pc.cache.blocks
    assert b.num_live == 0 and pc.cache.slots.num_live == 0  # every reference returned
    assert b.num_free + b.num_evictable == b.capacity
    assert pc.metrics.hits > 20 and pc.metrics.images_read == pc.metrics.hits


def test_presets_build_a_prefix_cache():
    m = model_cache("qwen3-next-80b-a3b", ServingOptions(tp=8))
    pc = PrefixCache(plan_cache(m, budget_bytes=256 << 20, max_seqs=2), "meta")
    assert pc.spec is not None and pc.cache.buf.device.type == "meta"
    llama = PrefixCache(
        plan_cache(model_cache("llama-3.1-8b"), budget_bytes=1 << 30, max_seqs=2), "meta"
    )
    adm = llama.admit("a", np.arange(100))
    llama.commit("a", 100)
    llama.finish("a")
    assert llama.lookup(np.arange(120)).tokens == 96 and adm.checkpoints == []


def test_tails_age_first_and_an_image_goes_with_its_last_block():
    pc = make(policy=CheckpointPolicy(end=True, branch=False, learn=False))
    adm = run(pc, "a", np.arange(24))  # 6 blocks, an image at 6
    blocks = list(adm.blocks)
    pc.finish("a")
    b = pc.cache.blocks
    lru = b.evictable_blocks()
    # The prompt's tail is the first to go, its head (what others share) the last.
    kv_order = [x for x in lru if x in blocks]
    assert kv_order == blocks[::-1]
    assert pc.images == 1
    b.evict(blocks[-1])  # the image's last KV block: the image cannot be resumed from
    assert pc.images == 0 and pc.metrics.evicted_images == 1
    pc.check_books()
    assert pc.lookup(np.arange(30)).tokens == 0


def test_a_dropped_prefix_cache_frees_its_cache_at_once():
    """No cycle holds the cache: the allocator's write-down sink holds the buffer
    and the metrics, never the prefix cache, so dropping the prefix cache frees
    the cache (and its buffer) by reference counting, not at the next cyclic
    collection, and replays in a row do not each keep a budget's worth of
    memory. While it lives, evictions are counted."""
    import gc
    import weakref

    pc = make()
    run(pc, "a", np.arange(16))
    pc.finish("a")
    cached = [b for b in range(pc.cache.num_blocks) if pc.cache.blocks.is_evictable(b)]
    assert cached
    before = pc.metrics.evicted_blocks + pc.metrics.evicted_images
    pc.cache.blocks.evict(cached[0])
    assert pc.metrics.evicted_blocks + pc.metrics.evicted_images == before + 1
    ref = weakref.ref(pc.cache)
    gc.disable()
    try:
        del pc
        assert ref() is None
    finally:
        gc.enable()
