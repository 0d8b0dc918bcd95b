"""``TierSpec``: the one parser of the tier spec grammar (kvarena.tiers.spec)."""

from __future__ import annotations

import pytest

from kvarena.errors import InvalidValueError
from kvarena.tiers import SPEC_FORMS, TierSpec, TierSpecError
from kvarena.tiers.disk import DiskTier
from kvarena.tiers.host import HostTier


@pytest.mark.parametrize(
    "text,want,canonical",
    [
        ("host:4GiB", TierSpec(kind="host", size=4 << 30), f"host:{4 << 30}"),
        (" host:512 ", TierSpec(kind="host", size=512), "host:512"),
        (
            "disk:/var/kv:a:200GiB",  # the size is after the last colon
            TierSpec(kind="disk", size=200 << 30, directory="/var/kv:a"),
            f"disk:/var/kv:a:{200 << 30}",
        ),
        ("redis://h:6379/2", TierSpec(kind="redis", url="redis://h:6379/2"), "redis://h:6379/2"),
        ("unix:///tmp/r.sock", TierSpec(kind="redis", url="unix:///tmp/r.sock"), None),
        (
            "redis+cluster://h:7000",
            TierSpec(kind="redis", url="redis://h:7000", cluster=True),
            "redis+cluster://h:7000",
        ),
    ],
)
def test_each_form_parses_and_prints_back(text, want, canonical):
    spec = TierSpec.parse(text)
    assert spec == want
    assert str(spec) == (canonical or text.strip())
    assert TierSpec.parse(str(spec)) == spec and TierSpec.parse(spec) is spec


@pytest.mark.parametrize(
    "bad,reason",
    [
        ("host", SPEC_FORMS),
        ("host:", SPEC_FORMS),
        ("disk:/x", SPEC_FORMS),
        ("tape:1GiB", SPEC_FORMS),
        ("", SPEC_FORMS),
        (None, SPEC_FORMS),
        (7, SPEC_FORMS),
        ("host:lots", "lots"),
        ("disk:/x:-1", "-1"),
    ],
)
def test_a_spec_that_names_no_tier_is_refused_with_its_reason(bad, reason):
    with pytest.raises(TierSpecError) as err:
        TierSpec.parse(bad)
    assert reason in err.value.reason and repr(bad) in str(err.value)
    assert str(err.value) == f"tier {bad!r}: {err.value.reason}"


def test_a_share_divides_sizes_and_moves_a_directory(tmp_path):
    host, disk, redis = (
        TierSpec.parse(s) for s in ("host:4GiB", f"disk:{tmp_path}:8GiB", "redis://h:1")
    )
    assert host.share(4) == TierSpec(kind="host", size=1 << 30)
    assert disk.share(4, directory=f"{tmp_path}/tp3") == TierSpec(
        kind="disk", size=2 << 30, directory=f"{tmp_path}/tp3"
    )
    assert redis.share(4) is redis


def test_a_spec_opens_its_tier(tmp_path):
    host = TierSpec.parse("host:1MiB").open(frame_bytes=4096)
    disk = TierSpec.parse(f"disk:{tmp_path}/d:2MiB").open()
    try:
        assert isinstance(host, HostTier) and host.capacity_bytes == 1 << 20
        assert isinstance(disk, DiskTier) and disk.capacity_bytes == 2 << 20
    finally:
        host.close()
        disk.close()


def test_a_share_of_no_parts_is_refused():
    with pytest.raises(InvalidValueError, match="parts"):
        TierSpec.parse("host:1GiB").share(0)


def test_a_place_to_read_is_a_spec_a_sizeless_disk_or_a_directory():
    from kvarena.tiers.spec import TierSpec

    assert TierSpec.parse_place("/var/kv") == TierSpec(kind="disk", directory="/var/kv")
    assert TierSpec.parse_place("disk:/var/kv") == TierSpec(kind="disk", directory="/var/kv")
    assert TierSpec.parse_place("disk:/var/kv:1GiB") == TierSpec.parse("disk:/var/kv:1GiB")
    assert TierSpec.parse_place("redis://h:1/2") == TierSpec(kind="redis", url="redis://h:1/2")
    assert TierSpec.parse_place("host:1GiB").kind == "host"
    with pytest.raises(TierSpecError):
        TierSpec.parse_place("")


def test_a_store_url_reads_its_secret_from_the_environment(monkeypatch):
    """``${NAME}`` in a store URL is the environment variable NAME when the tier
    opens (quoted for a URL); the spec keeps the name, never the value."""
    monkeypatch.setenv("KVARENA_TEST_PW", "p@ss:w/rd")
    monkeypatch.setenv("KVARENA_TEST_HOST", "store.internal")
    spec = TierSpec.parse("redis://:${KVARENA_TEST_PW}@${KVARENA_TEST_HOST}:6379/1")
    assert str(spec) == "redis://:${KVARENA_TEST_PW}@${KVARENA_TEST_HOST}:6379/1"
    assert spec.store_url() == "redis://:p%40ss%3Aw%2Frd@store.internal:6379/1"
    cluster = TierSpec.parse("redis+cluster://:${KVARENA_TEST_PW}@h:7000")
    assert cluster.cluster and cluster.store_url() == "redis://:p%40ss%3Aw%2Frd@h:7000"
    assert TierSpec.parse("disk:/tmp/${NOT_READ}:1GiB").directory == "/tmp/${NOT_READ}"
    monkeypatch.delenv("KVARENA_TEST_PW")
    with pytest.raises(TierSpecError, match="the environment has no KVARENA_TEST_PW"):
        TierSpec.parse("redis://:${KVARENA_TEST_PW}@h:6379")
    with pytest.raises(TierSpecError, match="the environment has no KVARENA_TEST_PW"):
        spec.store_url()  # gone since the spec was parsed
