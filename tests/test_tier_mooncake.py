"""The Mooncake Store tier against a real ``mooncake_master`` on loopback (TCP):
round trips by bytes, objects larger than a read's share, two clients sharing
the pool, the prefix cache over it, and the master going away mid-run.
Skipped where Mooncake's client is not installed (``kvarena[mooncake]``)."""

from __future__ import annotations

import os
import warnings

import pytest
from test_tier_prefix import compute, make, prompts
from test_tier_redis import images

try:
    import mooncake.store  # noqa: F401
except ImportError as exc:  # not installed, or its libibverbs missing
    if os.environ.get("CI"):  # `make test` installs both
        pytest.fail(f"Mooncake's client does not load: {exc}", pytrace=False)
    pytest.skip(f"Mooncake's client does not load: {exc}", allow_module_level=True)

from kvarena.testing.mooncake_master import MooncakeMaster
from kvarena.tiers import MooncakeTier, Put, TierStack, TierWarning, parse_tier
from kvarena.tiers.spec import TierSpec


@pytest.fixture
def master(tmp_path):
    with MooncakeMaster(tmp_path / "master.log") as m:
        yield m


SEGMENT = "/256MiB"


def test_a_round_trip_by_bytes(master):
    tier = parse_tier(master.url + SEGMENT)
    assert isinstance(tier, MooncakeTier) and not tier.cascades
    objs = images(20)  # payloads of 1 KB to 156 KB
    assert tier.put_many(objs) == Put()
    names = [o.name for o in objs]
    assert tier.contains_many([*names, "kv-none"]) == [True] * 20 + [False]
    got = tier.get_many([*names, "kv-none"])
    assert [bytes(g) for g in got[:-1]] == [o.to_bytes() for o in objs] and got[-1] is None
    assert tier.metrics.hits == 20 and tier.metrics.misses == 1
    assert tier.metrics.get_bytes == sum(o.logical_bytes for o in objs)
    assert tier.delete_many(names[:5]) == 5
    assert tier.contains_many(names[:6]) == [False] * 5 + [True]
    tier.close()


def test_an_object_larger_than_the_staging_buffer_is_refused_by_name(master):
    """A put names what it could not store (an object past the client's staging
    buffer): its neighbours in the batch are stored, it is not."""
    tier = MooncakeTier(
        master.url[len("mooncake://") :], segment_bytes=64 << 20, staging_bytes=1 << 20
    )
    small = images(2)
    huge = small[0].__class__("kv-huge", (b"x" * (2 << 20),), 2 << 20)
    assert tier.put_many([small[0], huge, small[1]]) == Put(refused=["kv-huge"])
    assert tier.contains_many([small[0].name, "kv-huge", small[1].name]) == [True, False, True]
    tier.close()


def test_objects_larger_than_a_reads_share_are_read_alone(master):
    """Many small objects fix the share a read gives each; a large one read among
    them does not fit its share and is read again alone, byte for byte."""
    small = MooncakeTier(
        master.url[len("mooncake://") :], segment_bytes=64 << 20, staging_bytes=4 << 20
    )
    objs = images(12)
    small.put_many(objs[:4])
    small.get_many([o.name for o in objs[:4]])  # the largest seen: a few KB
    big = images(1)[0].__class__("kv-big", (b"x" * (3 << 20),), 3 << 20)
    small.put_many([big, *objs[4:]])
    names = [o.name for o in objs] + ["kv-big"]
    got = small.get_many(names)
    assert [bytes(g) for g in got] == [o.to_bytes() for o in objs] + [b"x" * (3 << 20)]
    small.close()


def test_two_clients_share_the_pool(master):
    """What one server's cache drained into the store, another (a fresh cache,
    another client of the same master) hits, every restored byte checked."""
    ps = prompts(8)
    first = make(TierStack([parse_tier(master.url + SEGMENT)]))
    for i, p in enumerate(ps):
        compute(first, i, p)
    first.drain()
    second = make(TierStack([parse_tier(master.url + SEGMENT)]))
    for i, p in enumerate(ps):
        adm = compute(second, i, p)  # compute checks every restored byte
        assert adm.hit.tokens == 32 and set(adm.hit.sources) == {"mooncake"}
    assert second.metrics.tier_rejected == {}


def test_a_master_gone_costs_misses_and_one_warning(master):
    tier = parse_tier(master.url + SEGMENT)
    objs = images(4)
    tier.put_many(objs)
    master.stop()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = tier.get_many([o.name for o in objs])
        tier.put_many(images(2))
    assert got == [None] * len(objs) and tier.metrics.failures >= 1
    assert len([w for w in seen if issubclass(w.category, TierWarning)]) == 1
    tier.close()


@pytest.mark.parametrize(
    "text, words",
    [
        ("mooncake://", "mooncake://HOST:PORT"),
        ("mooncake://host", "mooncake://HOST:PORT"),
        ("mooncake://host:99999", "mooncake://HOST:PORT"),
        ("mooncake://host:50051/lots", "lots"),
    ],
)
def test_bad_mooncake_specs_are_refused(text, words):
    from kvarena.tiers.spec import TierSpecError

    with pytest.raises(TierSpecError, match=words):
        TierSpec.parse(text)


def test_a_spec_reads_back_and_shares_its_segment():
    spec = TierSpec.parse("mooncake://10.0.0.5:50051/8GiB")
    assert (spec.kind, spec.url, spec.size) == ("mooncake", "10.0.0.5:50051", 8 << 30)
    assert TierSpec.parse(str(spec)) == spec
    assert spec.share(4).size == 2 << 30
    assert TierSpec.parse("mooncake://m:1").size == 1 << 30
