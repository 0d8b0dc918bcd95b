"""The one book of cached blocks (``kvarena.pools.cached_keys``), inside the allocator.

Random operations against a plain reference: which key each block holds,
what a key's eviction takes with it (its other blocks, the key worthless
without it), and that a relocation carries keys along.
"""

from __future__ import annotations

import random

import pytest

from kvarena.errors import InvalidValueError
from kvarena.pools import BlockAllocator


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_the_book_with_the_reference(seed):
    rng = random.Random(seed)
    a = BlockAllocator(24)
    seen = []
    a.set_write_down(lambda victims: seen.extend(victims))
    ref: dict[object, tuple[int, ...]] = {}  # key -> blocks
    held: list[int] = []  # live blocks, one reference each
    n = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.35 and a.num_free + a.num_evictable:
            k = rng.randint(1, min(3, a.num_free + a.num_evictable))
            before = dict(ref)
            seen.clear()
            got = a.allocate(k)
            for v in seen:  # evicted keys: gone from the book, their blocks reported whole
                assert before[v.key] == v.blocks
                del ref[v.key]
            held.extend(got)
        elif op < 0.6 and held:
            free = [b for b in held if a.key_of(b) is None]
            k = min(len(free), rng.randint(1, 3))
            if k:
                blocks = rng.sample(free, k)
                n += 1
                after = None
                kv_keys = [key for key in ref if isinstance(key, int)]
                if k > 1 and kv_keys and rng.random() < 0.5:
                    after = rng.choice(kv_keys)
                    if a._keys.dependent_of(after) is not None:
                        after = None
                key = ("image", n) if k > 1 else n
                a.cache(key, blocks, tag=n, after=after)
                ref[key] = tuple(blocks)
        elif op < 0.85 and held:
            b = held.pop(rng.randrange(len(held)))
            a.release(b)
        elif a.evictable_blocks():
            b = rng.choice(a.evictable_blocks())
            before = dict(ref)
            victims = a.evict(b)
            assert victims[0].key == a_key_of(before, b)
            for v in victims:
                assert before[v.key] == v.blocks
                del ref[v.key]
        assert {key: a.blocks_of(key) for key in ref} == ref
        assert sorted(map(repr, a.keys())) == sorted(map(repr, ref))
        for key, blocks in ref.items():
            assert all(a.key_of(b) == key for b in blocks)
        a.check_books()


def a_key_of(book, block):
    return next(k for k, blocks in book.items() if block in blocks)


def test_evicting_a_block_evicts_its_whole_key_and_its_dependent():
    a = BlockAllocator(8)
    kv, image = a.allocate(1), a.allocate(3)
    a.cache(b"kv", kv, tag=4)
    a.cache(("image", b"kv"), image, tag=5, after=b"kv")
    for b in kv + image:
        a.release(b)
    victims = a.evict(image[1])  # one unit: the whole image goes, the KV stays
    assert [(v.key, v.blocks, v.tag) for v in victims] == [(("image", b"kv"), tuple(image), 5)]
    assert a.blocks_of(b"kv") == tuple(kv) and a.num_free == 8 - 1
    image = a.allocate(3)
    a.cache(("image", b"kv"), image, tag=5, after=b"kv")
    for b in image:
        a.release(b)
    victims = a.evict(kv[0])  # the KV block ending at the boundary: the image with it
    assert [v.key for v in victims] == [b"kv", ("image", b"kv")]
    assert a.num_keys == 0 and a.num_free == 8
    a.check_books()


def test_a_held_dependent_outlives_its_key_and_ages_later():
    a = BlockAllocator(6)
    kv, image = a.allocate(1), a.allocate(2)
    a.cache(b"kv", kv)
    a.cache(("image", b"kv"), image, after=b"kv")
    a.release(kv[0])  # the image's writer still holds its units
    assert [v.key for v in a.evict(kv[0])] == [b"kv"]
    assert a.blocks_of(("image", b"kv")) == tuple(image)
    for b in image:
        a.release(b)
    assert a.evictable_blocks() == image
    a.check_books()


def test_keys_move_with_relocated_blocks():
    a = BlockAllocator(8)
    got = a.allocate(3)
    a.cache(b"x", [got[2]])
    a.cache(("image", b"x"), got[:2])
    a.move_many([(got[0], 6), (got[2], 7)])
    assert a.blocks_of(b"x") == (7,) and a.blocks_of(("image", b"x")) == (6, got[1])
    assert a.key_of(got[0]) is None and a.key_of(6) == ("image", b"x")
    a.check_books()


def test_cache_refusals_change_nothing():
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    a.cache(b"k", [blocks[0]])
    for call, match in (
        (lambda: a.cache(b"k", [blocks[1]]), "cached already"),
        (lambda: a.cache(b"j", [blocks[0]]), "holds key"),
        (lambda: a.cache(b"j", [3]), "free"),
        (lambda: a.cache(b"j", []), "at least one"),
        (lambda: a.cache(b"j", [blocks[1], blocks[1]]), "distinct"),
        (lambda: a.cache([1], [blocks[1]]), "hashable"),
        (lambda: a.cache(b"j", [blocks[1]], tag=1.5), "tag"),
        (lambda: a.cache(None, [blocks[1]]), "cache: key None"),
        (lambda: a.cache(b"j", [blocks[1]], after=[2]), "cache: after"),
    ):
        with pytest.raises(InvalidValueError, match=match):
            call()
    assert a.keys() == [b"k"] and a.key_of(blocks[1]) is None
    a.check_books()
    # a None key would be no key: the block released would go free while named
    a.release(blocks[1])
    assert a.is_cached(blocks[0]) and a.num_live == 1
    a.check_books()
