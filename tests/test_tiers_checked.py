"""One path for checked objects (kvarena.tiers.checked) and the stack's write
paths: the span rule, fetch-check-drop-try-the-next-tier, and the seal rule."""

from __future__ import annotations

import contextlib

import pytest

from kvarena.errors import InvalidValueError
from kvarena.tiers import DiskTier, HostTier, TierStack
from kvarena.tiers.checked import Expectations, fetch_checked, object_span
from kvarena.tiers.image import TierObject, read_header
from kvarena.tiers.names import ImageKind, object_name

BS = 16
EXPECT = Expectations(namespace=b'{"m":"x"}', block_size=BS, kv_bytes=64, state_bytes=96)
OTHER = Expectations(namespace=b'{"m":"y"}', block_size=BS, kv_bytes=64, state_bytes=96)


def _key(i: int) -> bytes:
    return bytes([i]) * 16


def _kv(i: int, fill: int, expect: Expectations = EXPECT) -> TierObject:
    return expect.encode(ImageKind.KV_BLOCK, _key(i), i, [memoryview(bytes([fill]) * 64)])


def _bytes(obj: TierObject) -> bytes:
    return b"".join(bytes(p) for p in obj.parts)


@pytest.fixture
def stack(tmp_path):
    s = TierStack([HostTier(1 << 20, frame_bytes=4096), DiskTier(tmp_path / "d", 1 << 20)])
    yield s
    s.close()


def test_the_span_rule():
    assert object_span(ImageKind.KV_BLOCK, 3, BS) == (48, 64)
    assert object_span(ImageKind.STATE, 3, BS) == (0, 48)
    kv, state = EXPECT.kv(_key(1), 3), EXPECT.state(_key(1), 3)
    assert (kv.start, kv.end, kv.payload_bytes) == (48, 64, 64)
    assert (state.start, state.end, state.payload_bytes) == (0, 48, 96)
    header = read_header(
        _bytes(EXPECT.encode(ImageKind.STATE, _key(1), 3, [memoryview(b"s" * 96)]))
    )
    assert (header.start, header.end) == (0, 48)  # the saver encodes what a load expects


def test_write_through_puts_everything_everywhere_sealing_only_below_host(stack):
    objects = [_kv(i, i) for i in range(3)]
    written = stack.write_through(objects)
    assert written.evicted == {"host": [], "disk": []}
    stored = sum(o.stored_bytes for o in objects)
    assert written.nbytes["host"] == stored  # unsealed in host memory
    assert written.nbytes["disk"] == sum(o.stored_bytes for o in stack.tiers[1].stored(objects))
    assert set(written.seconds) == {"host", "disk"} and min(written.seconds.values()) >= 0
    host, disk = stack.tiers
    assert host.contains_many([o.name for o in objects]) == [True] * 3
    assert disk.contains_many([o.name for o in objects]) == [True] * 3
    assert not read_header(bytes(host.get_many([objects[0].name])[0])).sealed
    assert read_header(bytes(disk.get_many([objects[0].name])[0])).sealed
    assert host.stored(objects) == objects  # trusted: as handed
    assert all(read_header(_bytes(o)).sealed for o in disk.stored(objects))


def test_write_through_names_what_each_tier_refused(tmp_path):
    """A tier that does not store an object (here a disk smaller than it) says
    so by its label; the tiers that took it hold it."""
    small = [_kv(1, 1)]
    big = EXPECT.encode(ImageKind.STATE, _key(9), 9, [memoryview(b"s" * 96)])
    disk = DiskTier(tmp_path / "d", big.logical_bytes - 1)
    stack = TierStack([HostTier(1 << 20, frame_bytes=4096), disk])
    try:
        written = stack.write_through([*small, big])
        assert written.refused == {"host": [], "disk": [big.name]}
        assert stack.tiers[0].contains_many([big.name]) == [True]
        assert written.evicted == {"host": [], "disk": []}
        assert (
            written.nbytes["disk"] == disk.stored(small)[0].stored_bytes
        )  # the refused not counted
        assert disk.contains_many([small[0].name, big.name]) == [True, False]
    finally:
        stack.close()


def test_a_failing_object_is_dropped_and_taken_from_the_tier_below(stack):
    host, disk = stack.tiers
    good, foreign = _kv(1, 7), _kv(1, 9, OTHER)
    disk.put_many(disk.stored([good]))
    host.put_many([foreign])  # same name, another namespace: fails its checks
    wanted = [
        (good.name, EXPECT.kv(_key(1), 1)),
        (object_name(ImageKind.KV_BLOCK, _key(2)), EXPECT.kv(_key(2), 2)),
    ]
    for held in (None, contextlib.ExitStack()):
        with held or contextlib.nullcontext():
            got = fetch_checked(stack, wanted, held=held)
            assert bytes(got.payloads[0]) == bytes([7]) * 64 and got.payloads[1] is None
        assert got.failed == [wanted[1][0]]
        if held is not None:  # the host's copy was dropped by the first fetch
            assert got.rejected == []
            continue
        assert [(r.label, r.name, r.reason) for r in got.rejected] == [
            ("host", good.name, "namespace")
        ]
        # what each tier was asked took, and the stored bytes it returned
        assert got.read_bytes == {"host": foreign.stored_bytes, "disk": good.stored_bytes}
        assert set(got.seconds) == {"host", "disk"}
        assert got.dropped_hosted == [good.name]
        assert host.contains_many([good.name]) == [False]


def test_what_the_host_tier_lends_in_place_is_named_by_its_offset(stack):
    """A held fetch says where in the host tier's allocation each payload it
    lent lies (its level and offset): those bytes are the payload's exactly;
    what a lower tier served, or a fetch not held, is not lent."""
    host, disk = stack.tiers
    objects = [_kv(i, 10 + i) for i in range(3)]
    host.put_many(objects[:2])
    disk.put_many(disk.stored(objects[2:]))
    wanted = [(o.name, EXPECT.kv(_key(i), i)) for i, o in enumerate(objects)]
    with contextlib.ExitStack() as held:
        got = fetch_checked(stack, wanted, held=held)
        for j in (0, 1):
            assert got.lent[j] is not None and got.lent[j][0] == 0
            at = got.lent[j][1]
            payload = bytes(got.payloads[j])
            assert payload == bytes([10 + j]) * 64
            assert bytes(host.buffer[at : at + len(payload)].numpy()) == payload
        assert got.lent[2] is None and bytes(got.payloads[2]) == bytes([12]) * 64
    assert fetch_checked(stack, wanted).lent == [None, None, None]


def test_first_skips_the_tiers_above_where_an_object_was_found(stack):
    host, disk = stack.tiers
    good, foreign = _kv(3, 5), _kv(3, 6, OTHER)
    disk.put_many(disk.stored([good]))
    host.put_many([foreign])
    got = fetch_checked(stack, [(good.name, EXPECT.kv(_key(3), 3))], first=[1])
    assert bytes(got.payloads[0]) == bytes([5]) * 64 and not got.rejected
    assert host.contains_many([good.name]) == [True]  # never asked, never dropped


def test_a_corrupt_object_below_everything_is_a_failure(stack):
    _, disk = stack.tiers
    obj = disk.stored([_kv(4, 1)])[0]
    raw = bytearray(_bytes(obj))
    raw[-1] ^= 0xFF  # a flipped payload byte: the checksum no longer matches
    disk.put_many([TierObject(obj.name, (bytes(raw),), len(raw))])
    got = fetch_checked(stack, [(obj.name, EXPECT.kv(_key(4), 4))])
    assert got.payloads == [None] and got.failed == [obj.name]
    assert [(r.label, r.reason) for r in got.rejected] == [("disk", "checksum")]
    assert disk.contains_many([obj.name]) == [False]


def test_a_write_through_in_progress_does_not_hold_up_a_fetch(tmp_path):
    """The background writer's disk write must not make a load wait: while a
    write-through sits inside a tier's put, the stack still serves a fetch."""
    import threading

    entered, release = threading.Event(), threading.Event()

    class SlowDisk(DiskTier):
        def put_many(self, objects, *, want_evicted=True):
            entered.set()
            release.wait()
            return super().put_many(objects, want_evicted=want_evicted)

    host, disk = HostTier(1 << 20, frame_bytes=4096), SlowDisk(tmp_path / "d", 1 << 20)
    stack = TierStack([host, disk])
    try:
        host.put_many([_kv(5, 3)])
        writer = threading.Thread(target=stack.write_through, args=([_kv(6, 4)],))
        writer.start()
        assert entered.wait(20)  # a bound for a broken build, not a race
        got: list = []
        reader = threading.Thread(target=lambda: got.append(stack.fetch(0, [_kv(5, 3).name])))
        reader.start()
        reader.join(20)
        served = not reader.is_alive()
        release.set()
        writer.join(20)
        reader.join(20)
        assert served, "the fetch waited for the write-through's disk write"
        assert got and got[0][0] is not None
    finally:
        release.set()
        stack.close()


def test_a_fetch_stuck_in_a_tier_does_not_hold_up_a_write_through(tmp_path):
    """A load off the step may hang in a tier's read: the writer's write-through
    (and a fetch from another tier) must still run meanwhile."""
    import threading

    entered, release = threading.Event(), threading.Event()

    class StuckDisk(DiskTier):
        def get_many(self, names):
            entered.set()
            release.wait()
            return super().get_many(names)

    host, disk = HostTier(1 << 20, frame_bytes=4096), StuckDisk(tmp_path / "d", 1 << 20)
    stack = TierStack([host, disk])
    try:
        reader = threading.Thread(target=stack.fetch, args=(1, [_kv(7, 1).name]))
        reader.start()
        assert entered.wait(20)  # a bound for a broken build, not a race
        writer = threading.Thread(target=stack.write_through, args=([_kv(8, 2)],))
        writer.start()
        writer.join(20)
        wrote = not writer.is_alive()
        release.set()
        reader.join(20)
        writer.join(20)
        assert wrote, "the write-through waited for a stuck fetch"
        assert disk.contains_many([_kv(8, 2).name]) == [True]
    finally:
        release.set()
        stack.close()


def test_a_hint_that_names_no_tier_is_refused(stack):
    wanted = [(_kv(1, 1).name, EXPECT.kv(_key(1), 1))]
    for bad in ([2], [-1], [0, 0]):
        with pytest.raises(InvalidValueError, match="first"):
            fetch_checked(stack, wanted, first=bad)
    for bad_last in (2, -1, 0.5):  # the stack has levels 0 and 1
        with pytest.raises(InvalidValueError, match=r"last must name a level \(0\.\.1\)"):
            fetch_checked(stack, wanted, last=bad_last)
