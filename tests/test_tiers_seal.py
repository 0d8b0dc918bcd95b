"""Unsealed images: the host tier's one-copy hot path, and the seal every
other tier puts on before it writes.

An image held only in this process's memory needs no checksum; one written
where anything else can change it must have one. Checked by bytes: a sealed
image equals what ``encode`` seals at once, a disk or store write of an
unsealed image is sealed on the way, an unsealed image is refused by an
untrusted load, and the checksum still catches a flipped byte on disk."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvarena.tiers import (
    DiskTier,
    Expected,
    HostTier,
    ImageKind,
    ImageMismatch,
    TierStack,
    decode,
    encode,
    read_header,
    seal,
)

NS = b'{"ns":"seal"}'


def image(payload: list[bytes], *, sealed: bool, key: bytes = b"k" * 16, kind=ImageKind.STATE):
    n = sum(len(p) for p in payload)
    obj = encode(
        kind=kind,
        namespace=NS,
        key=key,
        start=0,
        end=32,
        payload=payload,
        payload_bytes=n,
        seal=sealed,
    )
    exp = Expected(kind=kind, key=key, namespace=NS, start=0, end=32, payload_bytes=n, elided=False)
    return obj, exp


@given(st.lists(st.binary(min_size=0, max_size=300), min_size=1, max_size=4))
def test_sealing_later_gives_the_bytes_sealing_at_once_gives(parts):
    now, exp = image(parts, sealed=True)
    later, _ = image(parts, sealed=False)
    assert not read_header(later.to_bytes()).sealed and read_header(now.to_bytes()).sealed
    assert seal(later).to_bytes() == now.to_bytes()
    assert seal(now) is now
    # Read back from the host tier as one buffer, then sealed: the same bytes.
    assert seal(type(later)(later.name, (later.to_bytes(),), later.logical_bytes)).to_bytes() == (
        now.to_bytes()
    )
    # Header and namespace in one part, the payload's parts after (another
    # writer's way of splitting it): the same bytes again.
    whole = later.to_bytes()
    head = len(whole) - sum(len(p) for p in parts)
    split = type(later)(later.name, (whole[:head], *parts), later.logical_bytes)
    assert seal(split).to_bytes() == now.to_bytes()
    assert bytes(decode(now.to_bytes(), exp)) == b"".join(parts)


def test_an_unsealed_image_is_refused_unless_read_from_trusted_memory():
    obj, exp = image([b"abc" * 50], sealed=False)
    with pytest.raises(ImageMismatch) as err:
        decode(obj.to_bytes(), exp)
    assert err.value.reason == "unsealed"
    assert bytes(decode(obj.to_bytes(), exp, trusted=True)) == b"abc" * 50
    # Trusted skips only the checksum: every other field is still checked.
    with pytest.raises(ImageMismatch, match="key"):
        decode(obj.to_bytes(), Expected(**{**exp.__dict__, "key": b"x" * 16}), trusted=True)


def test_host_holds_unsealed_and_disk_seals_what_it_is_handed(tmp_path):
    host = HostTier(1 << 20, frame_bytes=4096)
    disk = DiskTier(tmp_path / "d", 1 << 20)
    assert host.trusted and not disk.trusted
    stack = TierStack([host, disk])
    objs = [image([bytes([i]) * 5000], sealed=False, key=bytes([i]) * 16) for i in range(3)]
    stack.write_back([o for o, _ in objs])
    for obj, exp in objs:
        stored = host.get_many([obj.name])[0]
        assert not read_header(stored).sealed
        assert bytes(decode(stored, exp, trusted=True)) == obj.to_bytes()[-5000:]
    # What the host evicts goes down sealed: a write-through of the same objects too.
    disk.put_many([o for o, _ in objs])
    for obj, exp in objs:
        on_disk = disk.get_many([obj.name])[0]
        assert read_header(on_disk).sealed
        assert bytes(decode(on_disk, exp)) == obj.to_bytes()[-5000:]
    # A flipped payload byte on disk is caught by the seal's checksum.
    f = next((tmp_path / "d").glob("*.kvi"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    name = f.name[: -len(".kvi")]
    exp = next(e for o, e in objs if o.name == name)
    with pytest.raises(ImageMismatch, match="checksum"):
        decode(disk.get_many([name])[0], exp)
    disk.close()


def test_borrow_reads_in_place_under_the_lock_and_copies_a_split_object(tmp_path):
    """Views of one-run objects, copies of split ones, None for a miss; ``lend``
    names where each view starts in the tier's buffer, counted as gets."""
    import threading

    from kvarena.tiers import TierObject

    host = HostTier(16 * 4096, frame_bytes=4096)
    objs = [TierObject(f"o{i}", (bytes([i]) * 4000,), 4000) for i in range(3)]
    host.put_many(objs)
    host.delete_many(["o1"])  # frees frame 1: the next two-frame object is split (1, 3)
    split = TierObject("split", (b"s" * 8000,), 8000)
    host.put_many([split])
    assert host._frames["split"] == [1, 3]
    names = ["o0", "split", "missing", "o2"]
    copies = host.get_many(names)
    with host.borrow(names) as views:
        assert [None if v is None else bytes(v) for v in views] == [
            None if c is None else bytes(c) for c in copies
        ]
        assert views[0].readonly and views[2] is None
        # In place: a one-run object is a view of the tier's own buffer; a split one a copy.
        assert views[0].obj is host._mv.obj and views[1].obj is not host._mv.obj
        taken = []
        other = threading.Thread(target=lambda: taken.append(host._lock.acquire(blocking=False)))
        other.start()
        other.join()
        assert taken == [False]  # no put can reuse the frames while they are borrowed
    before = host.metrics.to_dict()
    with host.lend(names) as lent:  # the same views, each with where it starts
        assert lent[2] is None and lent[1] is not None and lent[1][1] is None  # a copy
        for (view, at), want in zip((lent[0], lent[3]), ("o0", "o2"), strict=True):
            assert at == host._frames[want][0] * 4096
            assert bytes(host.buffer[at : at + len(view)].numpy()) == bytes(view)
    after = host.metrics.to_dict()
    assert {k: after[k] - before[k] for k in ("gets", "hits", "misses", "get_bytes")} == {
        "gets": 4,
        "hits": 3,
        "misses": 1,
        "get_bytes": 16000,
    }
    host.check_books()


def test_a_disk_batch_larger_than_the_tier_keeps_its_index_and_files_equal(tmp_path):
    """A batch that evicts its own first members: they never land as files, and
    they are handed down (as a host tier's evictions would be)."""
    disk = DiskTier(tmp_path / "d", 3 * 4200)
    objs = [image([bytes([i]) * 4000], sealed=False, key=bytes([i]) * 16)[0] for i in range(5)]
    down = disk.put_many(objs).evicted
    files = sorted(p.name[: -len(".kvi")] for p in (tmp_path / "d").glob("*.kvi"))
    assert files == sorted(disk.names()) == sorted(o.name for o in objs[2:])
    assert [o.name for o in down] == [o.name for o in objs[:2]]
    assert not list((tmp_path / "d").glob(".*.tmp"))  # no temporary left behind
    disk.close()
