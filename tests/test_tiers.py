"""The tier image format and the host and disk tiers: round trips, LRU books,
restarts, and the disk faults (a writer killed mid-write, a full disk)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvarena.errors import Error, InvalidValueError
from kvarena.tiers import (
    DiskTier,
    Expected,
    HostTier,
    ImageKind,
    ImageMismatch,
    Put,
    TierObject,
    TierStack,
    TierWarning,
    decode,
    encode,
    parse_tier,
    read_header,
    seal,
)
from kvarena.tiers.disk import LOCK_NAME
from kvarena.tiers.image import HEAD_BYTES

NS = b'{"model":"m","page":"p","state":"s"}'
SRC = str(Path(__file__).resolve().parents[1] / "src")


def image(kind=ImageKind.KV_BLOCK, key=b"k" * 16, span=(0, 16), payload=(b"abc", b"defg")):
    n = sum(len(p) for p in payload) if payload is not None else 7
    obj = encode(
        kind=kind,
        namespace=NS,
        key=key,
        start=span[0],
        end=span[1],
        payload=payload,
        payload_bytes=n,
    )
    exp = Expected(
        kind=kind,
        key=key,
        namespace=NS,
        start=span[0],
        end=span[1],
        payload_bytes=n,
        elided=payload is None,
    )
    return obj, exp


# -- the image format ------------------------------------------------------------------
@given(
    kind=st.sampled_from(list(ImageKind)),
    key=st.binary(min_size=16, max_size=16),
    start=st.integers(0, 1 << 40),
    length=st.integers(0, 1 << 20),
    parts=st.lists(st.binary(max_size=300), max_size=4),
    ns=st.binary(max_size=200),
)
def test_image_round_trip_and_header(kind, key, start, length, parts, ns):
    total = sum(len(p) for p in parts)
    obj = encode(
        kind=kind,
        namespace=ns,
        key=key,
        start=start,
        end=start + length,
        payload=parts,
        payload_bytes=total,
    )
    data = obj.to_bytes()
    assert len(data) == obj.stored_bytes == obj.logical_bytes == HEAD_BYTES + len(ns) + total
    exp = Expected(
        kind=kind,
        key=key,
        namespace=ns,
        start=start,
        end=start + length,
        payload_bytes=total,
        elided=False,
    )
    assert bytes(decode(data, exp)) == b"".join(parts)
    head = read_header(data)
    assert (head.kind, head.key, head.start, head.end, head.payload_bytes, head.namespace) == (
        int(kind),
        key,
        start,
        start + length,
        total,
        ns,
    )


@given(bit=st.integers(0, (HEAD_BYTES + len(NS) + 7) * 8 - 1))
def test_every_flipped_bit_is_a_mismatch(bit):
    obj, exp = image()
    data = bytearray(obj.to_bytes())
    data[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(ImageMismatch) as err:
        decode(data, exp)
    # A flip of the unsealed flag reads as an image with no checksum: refused as such.
    assert err.value.reason in ("checksum", "magic", "version", "truncated", "unsealed")


@given(cut=st.integers(0, HEAD_BYTES + len(NS) + 6))
def test_every_truncation_is_a_mismatch(cut):
    obj, exp = image()
    with pytest.raises(ImageMismatch, match="truncated"):
        decode(obj.to_bytes()[:cut], exp)


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("kind", ImageKind.STATE, "kind"),
        ("namespace", b'{"model":"other"}', "namespace"),
        ("key", b"x" * 16, "key"),
        ("start", 16, "span"),
        ("payload_bytes", 8, "length"),
    ],
)
def test_each_expected_field_is_checked(field, value, reason):
    from dataclasses import replace

    obj, exp = image()
    with pytest.raises(ImageMismatch) as err:
        decode(obj.to_bytes(), replace(exp, **{field: value}))
    assert err.value.reason == reason and isinstance(err.value, Error)


def test_elided_images_load_only_into_caches_without_bytes():
    obj, exp = image(payload=None)
    assert obj.stored_bytes == HEAD_BYTES + len(NS) and obj.logical_bytes == obj.stored_bytes + 7
    assert bytes(decode(obj.to_bytes(), exp)) == b""
    from dataclasses import replace

    with pytest.raises(ImageMismatch, match="elided"):
        decode(obj.to_bytes(), replace(exp, elided=False))


# -- the host tier ---------------------------------------------------------------------
@given(
    ops=st.lists(
        st.tuples(st.sampled_from("pgd"), st.integers(0, 15), st.integers(1, 7200)), max_size=80
    ),
    frame=st.sampled_from([512, 800, 2048]),
)
def test_host_tier_matches_an_lru_model(ops, frame):
    tier = HostTier(16384, frame_bytes=frame)
    model: OrderedDict[str, bytes] = OrderedDict()
    cap_frames = 16384 // frame

    def frames(n: int) -> int:
        return -(-n // frame)

    for op, i, size in ops:
        name = f"o{i}"
        if op == "p":
            data = bytes([i]) * size
            put = tier.put_many([TierObject(name, (data[:7], data[7:]), size)])
            evicted = put.evicted
            if name in model:
                model.move_to_end(name)
                assert put == Put()  # held: refreshed, neither evicting nor refused
                continue
            if frames(size) > cap_frames:
                assert put == Put(refused=[name]) and name not in model
                continue
            assert put.refused == []
            expect = []
            while sum(frames(len(v)) for v in model.values()) + frames(size) > cap_frames:
                old, v = model.popitem(last=False)
                expect.append((old, v))
            assert [(e.name, e.to_bytes()) for e in evicted] == expect
            model[name] = data
        elif op == "g":
            got = tier.get_many([name])[0]
            assert (bytes(got) if got is not None else None) == model.get(name)
            if name in model:
                model.move_to_end(name)
        else:
            assert tier.delete_many([name]) == (name in model)
            model.pop(name, None)
        tier.check_books()
        assert tier.names() == list(model)
        assert tier.used_bytes == sum(len(v) for v in model.values())


def test_host_tier_refuses_nonsense_at_the_door():
    for kwargs, words in (
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"capacity_bytes": 1000, "frame_bytes": 2000}, "smaller than one frame"),
        ({"capacity_bytes": 1 << 20, "frame_bytes": 64}, "frame_bytes must be"),
        ({"capacity_bytes": 1 << 20, "frame_bytes": 1}, "frame_bytes must be"),
        ({"capacity_bytes": 1 << 40, "frame_bytes": 512}, "use frames of at least 65,536 B"),
        ({"capacity_bytes": 1 << 20, "pin_memory": 1}, "pin_memory"),
    ):
        with pytest.raises(InvalidValueError, match=words):
            HostTier(**kwargs)


# -- the disk tier ---------------------------------------------------------------------
def test_disk_tier_round_trip_restart_and_lru(tmp_path):
    objs = [image(key=bytes([i]) * 16, payload=(bytes([i]) * 100,))[0] for i in range(5)]
    size = objs[0].logical_bytes
    tier = DiskTier(tmp_path, 3 * size)
    assert tier.put_many(objs[:3]) == Put() and len(tier) == 3
    tier.get_many([objs[0].name])  # objs[0] is now the most recent
    evicted = tier.put_many(objs[3:4]).evicted
    assert [e.name for e in evicted] == [objs[1].name]
    assert evicted[0].to_bytes() == objs[1].to_bytes()
    assert object_files(tmp_path) == sorted(o.name + ".kvi" for o in (objs[0], objs[2], objs[3]))
    # A restart rebuilds the index from the headers, oldest write first (file
    # times stamped apart here: within a batch they may tie at clock granularity).
    for age, o in enumerate((objs[2], objs[0], objs[3])):
        os.utime(tmp_path / (o.name + ".kvi"), ns=(10**18 + age, 10**18 + age))
    tier.close()  # one owner at a time: the restart takes the directory over
    again = DiskTier(tmp_path, 3 * size)
    assert again.names() == [objs[2].name, objs[0].name, objs[3].name]
    assert again.used_bytes == 3 * size
    assert [bytes(d) for d in again.get_many([o.name for o in objs[2:4]])] == [
        o.to_bytes() for o in objs[2:4]
    ]
    # A smaller capacity on restart sheds the oldest objects.
    again.close()
    small = DiskTier(tmp_path, size)
    assert small.names() == [objs[3].name]


def test_disk_tier_drops_unreadable_files_and_dead_writers_temporaries(tmp_path):
    good = image()[0]
    DiskTier(tmp_path, 1 << 20).put_many([good])
    (tmp_path / "st-junk.kvi").write_bytes(b"not an image")
    short = bytearray(good.to_bytes())[:-2]
    (tmp_path / "kv-short.kvi").write_bytes(short)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = tmp_path / f".kv-x.{int(dead.stdout)}.abcd.tmp"
    stale.write_bytes(b"partial")
    live = tmp_path / f".kv-y.{os.getppid()}.abcd.tmp"  # a live writer's file stays
    live.write_bytes(b"in progress")
    tier = DiskTier(tmp_path, 1 << 20)
    assert tier.names() == [good.name] and tier.dropped_on_start == 3
    assert object_files(tmp_path) == sorted([good.name + ".kvi", live.name])


def object_files(directory) -> list[str]:
    """The directory's files but the owner's lock, which the tier keeps there."""
    return sorted(p.name for p in Path(directory).iterdir() if p.name != LOCK_NAME)


def _child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_a_writer_killed_mid_write_leaves_no_visible_object(tmp_path):
    # The kernel kills the writer (SIGXFSZ) the moment its file passes 1 MiB: a
    # real death in the middle of a write, at a byte position fixed in advance.
    done = _child(
        """
        import os, resource, signal, sys
        from kvarena.tiers import DiskTier, TierObject
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel kills
        from kvarena.tiers import ImageKind, encode
        tier = DiskTier(sys.argv[1], 1 << 30)
        small = encode(kind=ImageKind.KV_BLOCK, namespace=b"ns", key=b"s" * 16, start=0, end=16,
                       payload=[b"s" * 1000], payload_bytes=1000)
        tier.put_many([small])
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        tier.put_many([TierObject("kv-big", (os.urandom(4 << 20),), 4 << 20)])
        print("survived")
        """,
        str(tmp_path),
    )
    assert done.returncode == -signal.SIGXFSZ, done.stderr
    temps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].stat().st_size == 1 << 20  # cut mid-object
    assert not (tmp_path / "kv-big.kvi").exists()
    tier = DiskTier(tmp_path, 1 << 30)
    small = "kv-" + (b"s" * 16).hex()
    assert tier.names() == [small] and tier.get_many(["kv-big"]) == [None]
    assert object_files(tmp_path) == [small + ".kvi"]  # the temporary is gone


def test_a_full_disk_disables_writes_and_reads_go_on(tmp_path):
    out = _child(
        """
        import json, os, resource, signal, sys, warnings
        from kvarena.tiers import DiskTier, TierObject, TierWarning
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (Python's default) the write fails: EFBIG
        tier = DiskTier(sys.argv[1], 1 << 30)
        tier.put_many([TierObject("kv-a", (b"a" * 1000,), 1000)])
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            tier.put_many([TierObject("kv-big", (b"b" * (2 << 20),), 2 << 20)])
            tier.put_many([TierObject("kv-c", (b"c" * 10,), 10)])  # refused: disabled
        got = tier.get_many(["kv-a", "kv-big", "kv-c"])
        print(json.dumps({
            "disabled": tier.disabled,
            "warnings": [str(w.message) for w in seen if issubclass(w.category, TierWarning)],
            "got": [None if g is None else len(g) for g in got],
            "files": sorted(f for f in os.listdir(sys.argv[1]) if f != ".kvarena-disk.lock"),
            "names": tier.names(),
        }))
        """,
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert "full" in doc["disabled"] and len(doc["warnings"]) == 1
    assert "writes disabled" in doc["warnings"][0]
    assert doc["got"] == [1000, None, None]
    assert doc["files"] == ["kv-a.kvi"] and doc["names"] == ["kv-a"]  # no partial object


def test_tier_specs_are_checked(tmp_path):
    assert isinstance(parse_tier("host:1MiB"), HostTier)
    disk = parse_tier(f"disk:{tmp_path}/d:2GiB")
    assert isinstance(disk, DiskTier) and disk.capacity_bytes == 2 << 30
    for bad in ("host", "host:lots", "disk:/x", "tape:1GiB", "", "disk:/x:0"):
        with pytest.raises(InvalidValueError):
            parse_tier(bad)
    # A stack opened from specs closes what it opened when a later spec fails.
    with pytest.raises(InvalidValueError, match="tape"):
        TierStack.from_specs(["host:1MiB", "tape:1GiB"])
    stack = TierStack([HostTier(1 << 20), HostTier(1 << 20)])
    assert stack.labels == ["host", "host2"]


def test_stack_cascades_evictions_down(tmp_path):
    objs = [image(key=bytes([i]) * 16, payload=(bytes([i]) * 1000,))[0] for i in range(4)]
    size = objs[0].logical_bytes
    host = HostTier(2 * size, frame_bytes=size)
    disk = DiskTier(tmp_path, 10 * size)
    stack = TierStack([host, disk])
    stack.write_back(objs)
    assert host.names() == [o.name for o in objs[2:]]
    assert disk.names() == [o.name for o in objs[:2]]
    assert stack.locate([o.name for o in objs] + ["kv-none"]) == [1, 1, 0, 0, None]
    assert bytes(stack.fetch(1, [objs[0].name])[0]) == objs[0].to_bytes()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_evictions_come_back_with_their_bytes_or_as_names_alone(tmp_path, kind):
    objs = [image(key=bytes([i]) * 16, payload=(bytes([i]) * 1000,))[0] for i in range(5)]
    size = objs[0].logical_bytes
    for want in (True, False):
        where = tmp_path / f"{kind}-{want}"
        tier = HostTier(2 * size, frame_bytes=size) if kind == "host" else DiskTier(where, 2 * size)
        try:
            first = tier.put_many(objs[:2], want_evicted=want)
            put = tier.put_many(objs[2:], want_evicted=want)  # one batch: its own first go
            evicted = put.evicted
            assert first == Put() and put.refused == []  # its own first: evicted, not refused
            assert [o.name for o in evicted] == [o.name for o in objs[:3]]
            assert [o.logical_bytes for o in evicted] == [size] * 3
            for o, was in zip(evicted, objs, strict=False):
                # Asked for: the bytes as stored; not asked: none read back at all.
                assert b"".join(bytes(p) for p in o.parts) == (
                    (was.to_bytes() if kind == "host" else seal(was).to_bytes()) if want else b""
                )
            assert tier.names() == [o.name for o in objs[3:]]
        finally:
            tier.close()


def test_host_object_split_over_frames_apart_reads_back_whole():
    import numpy as np

    frame = 1024
    tier = HostTier(4 * frame, frame_bytes=frame)
    fill = [TierObject(f"f{i}", (bytes([i]) * frame,), frame) for i in range(4)]
    tier.put_many(fill, want_evicted=False)
    tier.delete_many(["f1", "f3"])  # free frames 1 and 3: apart
    grid = np.arange(1200, dtype=np.uint8).reshape(40, 30)  # a 2-D buffer: 1,200 bytes
    obj = TierObject("split", (b"head" * 100, memoryview(grid)), 1600)
    assert tier.put_many([obj], want_evicted=False) == Put()
    (got,) = tier.get_many(["split"])
    assert bytes(got) == b"head" * 100 + grid.tobytes()
    tier.check_books()


def test_tier_warnings_are_a_category():
    assert issubclass(TierWarning, UserWarning)


@pytest.fixture
def small_filesystem(tmp_path):
    """A 1 MiB tmpfs (needs root and mount): a disk that really fills up (ENOSPC)."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_really_full_disk_disables_writes(small_filesystem):
    tier = DiskTier(small_filesystem, 100 << 20)  # the tier thinks it has room
    objs = [image(key=bytes([i]) * 16, payload=(bytes([i]) * (200 << 10),))[0] for i in range(8)]
    late = image(key=b"z" * 16)[0]
    with pytest.warns(TierWarning, match="writes disabled: the disk is full") as seen:
        put = tier.put_many(objs)
        # refused quietly: already disabled; and said so, for a book of the tier
        assert tier.put_many([late]) == Put(refused=[late.name])
    assert len(seen) == 1 and tier.disabled is not None
    held = tier.names()
    assert 0 < len(held) < 8
    assert put.refused == [o.name for o in objs if o.name not in held]  # exactly the rest
    assert object_files(small_filesystem) == sorted(
        n + ".kvi" for n in held
    )  # no temporary, no partial object
    got = tier.get_many(held)
    assert [bytes(g) for g in got] == [o.to_bytes() for o in objs if o.name in held]


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_put_names_what_it_did_not_store(tmp_path, kind):
    """A put says which objects it refused (one larger than the whole tier), not
    those it held already (refreshed) nor those its own batch evicted again:
    a book of the tier that adds the put's names and removes its refusals and
    evictions holds exactly what the tier holds."""
    objs = [image(key=bytes([i]) * 16, payload=(bytes([i]) * 1000,))[0] for i in range(4)]
    size = objs[0].logical_bytes
    big = image(key=b"b" * 16, payload=(b"b" * 4000,))[0]
    tier = HostTier(2 * size, frame_bytes=size) if kind == "host" else DiskTier(tmp_path, 2 * size)
    try:
        assert tier.put_many(objs[:1]) == Put()
        put = tier.put_many([objs[0], big, *objs[1:]], want_evicted=False)
        assert put.refused == [big.name]
        book = {o.name for o in [objs[0], big, *objs[1:]]}
        book -= {*put.refused, *(o.name for o in put.evicted)}
        assert book == set(tier.names()) == {objs[2].name, objs[3].name}
    finally:
        tier.close()


def test_tier_doors_refuse_nonsense():
    from kvarena.tiers import RedisTier

    for kwargs, words in (
        ({"url": 5}, "url must be"),
        ({"url": ""}, "url must be"),
        ({"url": "redis://127.0.0.1:1", "timeout_s": 0}, "timeout_s"),
        ({"url": "redis://127.0.0.1:1", "cluster": True, "direct_writes": True}, "one server"),
    ):
        with pytest.raises(InvalidValueError, match=words):
            RedisTier(**kwargs)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("start", -1, "start"),
        ("end", 1 << 64, "end"),
        ("start", 10**30, "start"),
        ("end", 1.5, "end"),
        ("payload_bytes", -7, "payload_bytes"),
        ("payload_bytes", 1 << 70, "payload_bytes"),
        ("kind", 7, "ImageKind"),
        ("key", "k" * 16, "16 bytes"),
        ("namespace", "ns", "namespace"),
    ],
)
def test_encode_refuses_a_header_field_it_cannot_hold(field, value, words):
    args = {
        "kind": ImageKind.KV_BLOCK,
        "namespace": NS,
        "key": b"k" * 16,
        "start": 0,
        "end": 16,
        "payload": None,
        "payload_bytes": 7,
    }
    args[field] = value
    if field == "end" and isinstance(value, int):
        args["start"] = 0
    with pytest.raises(InvalidValueError, match=words):
        encode(**args)


@pytest.mark.parametrize(
    ("name", "parts", "logical"),
    [
        ("", (b"x",), 1),
        (5, (b"x",), 1),
        ("kv-a", [b"x"], 1),
        ("kv-a", (object(),), 1),
        ("kv-a", (b"xyz",), 2),
        ("kv-a", (b"x",), 0),
        ("kv-a", (b"x",), 1.0),
    ],
)
def test_a_tier_object_must_hold_its_bytes(name, parts, logical):
    with pytest.raises(InvalidValueError, match="TierObject"):
        TierObject(name, parts, logical)
