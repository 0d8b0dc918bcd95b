"""A disk tier over a hostile directory: a bad file costs only itself, nothing blocks,
nothing is read unbounded, nothing the tier did not name is deleted, one owner."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from test_tiers import SRC, image, object_files

from kvarena.errors import InvalidValueError
from kvarena.tiers import DiskTier, ImageKind, TierError, TierObject, encode
from kvarena.tiers.disk import LOCK_NAME


def _three(tmp_path):
    objs = [image(key=bytes([i]) * 16, payload=(bytes([i]) * 100,))[0] for i in range(3)]
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put_many(objs)
    tier.close()
    return objs


def test_an_absurd_declared_payload_costs_only_its_own_file(tmp_path):
    objs = _three(tmp_path)
    # A header-only (elided) image declaring 2**50 payload bytes, named as ours.
    bad = encode(
        kind=ImageKind.KV_BLOCK,
        namespace=b"ns",
        key=b"z" * 16,
        start=0,
        end=16,
        payload=None,
        payload_bytes=1 << 50,
    )
    (tmp_path / (bad.name + ".kvi")).write_bytes(bad.to_bytes())
    tier = DiskTier(tmp_path, 1 << 20)
    assert sorted(tier.names()) == sorted(o.name for o in objs)
    assert tier.used_bytes == sum(o.logical_bytes for o in objs)
    assert object_files(tmp_path) == sorted(o.name + ".kvi" for o in objs)


def test_files_the_tier_does_not_name_are_left_alone(tmp_path):
    objs = _three(tmp_path)
    mine = {
        ".notes.tmp": b"a user's own temporary",
        ".kv-a.tmp": b"not the tier's pattern (no pid, no hex)",
        "README.txt": b"hello",
        "kv-a.kvi.bak": b"backup",
        "weird name.kvi": b"not a name the tier writes",
        ".hidden.kvi": b"dot files are not objects",
    }
    for name, data in mine.items():
        (tmp_path / name).write_bytes(data)
    tier = DiskTier(tmp_path, 1 << 20)
    assert sorted(tier.names()) == sorted(o.name for o in objs) and tier.dropped_on_start == 0
    for name, data in mine.items():
        assert (tmp_path / name).read_bytes() == data


@pytest.mark.parametrize("replacement", ["fifo", "link-to-zero", "link-out", "huge-file"])
def test_a_replaced_object_is_a_miss_without_hanging_or_reading_unbounded(tmp_path, replacement):
    objs = _three(tmp_path)
    path = tmp_path / (objs[1].name + ".kvi")
    path.unlink()
    outside = tmp_path.parent / f"{tmp_path.name}-outside.kvi"
    if replacement == "fifo":
        os.mkfifo(path)
    elif replacement == "link-to-zero":
        os.symlink("/dev/zero", path)
    elif replacement == "link-out":
        outside.write_bytes(objs[1].to_bytes())
        os.symlink(outside, path)
    else:
        with open(path, "wb") as f:  # sparse: 1 TiB the tier must not read
            f.truncate(1 << 40)
    # Opening the directory must not hang either (the index is rebuilt from headers).
    tier = DiskTier(tmp_path, 1 << 20)
    assert objs[1].name not in tier.names()
    assert sorted(tier.names()) == sorted(o.name for o in (objs[0], objs[2]))
    tier.close()
    if replacement == "link-out":
        assert outside.read_bytes() == objs[1].to_bytes()  # a link is never followed out
    # A file replaced after the index was built: the read itself must not hang.
    tier = DiskTier(tmp_path, 1 << 20)
    held = tmp_path / (objs[0].name + ".kvi")
    held.unlink()
    if replacement == "fifo":
        os.mkfifo(held)
    elif replacement == "huge-file":
        with open(held, "wb") as f:
            f.truncate(1 << 40)
    else:
        os.symlink("/dev/zero" if replacement == "link-to-zero" else outside, held)
    with pytest.warns(UserWarning) if replacement != "huge-file" else _nothing():
        assert tier.get_many([objs[0].name]) == [None]
    assert objs[0].name not in tier.names()  # forgotten: a miss from now on
    assert [bytes(b) for b in tier.get_many([objs[2].name])] == [objs[2].to_bytes()]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_one_owner_per_directory_across_processes(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
            import sys
            from kvarena.tiers import DiskTier
            tier = DiskTier(sys.argv[1], 1 << 20)
            print("held", flush=True)
            sys.stdin.read()  # until the parent closes the pipe
            """
            ),
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TierError, match=f"in use by process {holder.pid}"):
            DiskTier(tmp_path, 1 << 20)
        # Two owners would each count only their own objects: the capacity holds
        # because the second writer never gets in.
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    tier = DiskTier(tmp_path, 1 << 20)  # the owner is gone: the directory is free again
    with pytest.raises(TierError, match="in use by process"):
        DiskTier(tmp_path, 1 << 20)  # in this process too, while this tier holds it
    tier.close()
    DiskTier(tmp_path, 1 << 20).close()
    assert (tmp_path / LOCK_NAME).exists()


def test_a_killed_owner_frees_the_directory(tmp_path):
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom kvarena.tiers import DiskTier\n"
            "t = DiskTier(sys.argv[1], 1 << 20)\nprint('held', flush=True)\ntime.sleep(600)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    assert child.stdout.readline().strip() == "held"
    child.kill()
    child.wait(timeout=60)
    DiskTier(tmp_path, 1 << 20).close()


@pytest.mark.parametrize("directory", [None, "", 7, b"/tmp"])
def test_a_directory_that_is_not_a_path_is_refused(directory):
    with pytest.raises(InvalidValueError, match="directory must be a path"):
        DiskTier(directory, 1 << 20)


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "x" * 201, "kv a"])
def test_names_that_are_not_file_names_are_refused_before_anything_is_written(tmp_path, name):
    tier = DiskTier(tmp_path, 1 << 20)
    with pytest.raises(InvalidValueError, match="not a file name"):
        tier.put_many([image()[0], TierObject(name, (b"x",), 1)])
    assert tier.names() == [] and object_files(tmp_path) == []
