"""A store's password never leaves the URL it opens (kvarena.tiers.redact).

``redacted`` against the forms redis-py reads, then a real ``redis-server``
that asks for a password: the tier opens and serves with the URL as given,
and what kvarena writes for people — the tier's description, its warning when
the store goes, the refusal of a tier that cannot connect, ``kvarena tiers
stat`` in both its outputs, ``kvarena replay``'s JSON — names the store with
the password as ``***``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

from kvarena.tiers import TierObject, TierSpec, TierWarning
from kvarena.tiers.base import TierError
from kvarena.tiers.redact import redacted

SECRET = "p@ss:w/rd%7"


@pytest.mark.parametrize(
    "url,shown",
    [
        ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        (
            "rediss://bob:s3cret@h:6380/2?ssl_cert_reqs=none",
            "rediss://bob:***@h:6380/2?ssl_cert_reqs=none",
        ),
        ("redis+cluster://bob:s3cret@h:7000", "redis+cluster://bob:***@h:7000"),
        ("unix:///run/r.sock?db=1&password=s3cret", "unix:///run/r.sock?db=1&password=***"),
        ("redis://h:1/0?PASSWORD=s3cret", "redis://h:1/0?PASSWORD=***"),
        ("redis://:s3@cret@h:1", "redis://:***@h:1"),  # an @ in the password
        ("redis://bob@h:1/0", "redis://bob@h:1/0"),  # a user alone: no secret
        ("redis://:${REDIS_PW}@h:1", "redis://:${REDIS_PW}@h:1"),  # names the secret
        ("redis://h:1?password=${REDIS_PW}", "redis://h:1?password=${REDIS_PW}"),
        ("redis://h:6379/2", "redis://h:6379/2"),
        ("unix:///tmp/r.sock", "unix:///tmp/r.sock"),
        ("redis://[::1]:6379", "redis://[::1]:6379"),
        ("host:4GiB", "host:4GiB"),
        ("disk:/var/kv:a:200GiB", "disk:/var/kv:a:200GiB"),
        ("mooncake://h:50051/1GiB", "mooncake://h:50051/1GiB"),
    ],
)
def test_a_url_is_shown_without_its_password(url, shown):
    assert redacted(url) == shown
    assert "s3cret" not in redacted(url) and "cret" not in redacted(url)
    assert redacted(shown) == shown  # shown twice: the same


def test_a_url_that_does_not_parse_is_not_shown():
    assert redacted("redis://:s3cret@[::1:6379") == "<a URL that does not parse>"


@pytest.fixture
def guarded(tmp_path):
    from conftest import redis_binary

    from kvarena.testing.redis_server import RedisServer

    server = RedisServer(str(tmp_path), binary=redis_binary(), password=SECRET)
    yield server
    server.stop()


def _no_secret(text: str) -> None:
    assert SECRET not in text and "p%40ss" not in text and "w%2Frd" not in text, text


def test_a_tier_behind_a_password_serves_and_never_shows_it(guarded):
    spec = TierSpec.parse(guarded.url)
    assert str(spec) == guarded.url  # the canonical spec opens the same store
    tier = spec.open()
    assert tier.put_many([TierObject("a", (b"x" * 64,), 64)]).refused == []
    assert bytes(tier.get_many(["a"])[0]) == b"x" * 64
    _no_secret(tier.describe())
    assert ":***@127.0.0.1" in tier.describe()
    guarded.stop()  # the store goes: the tier warns, naming it
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert tier.get_many(["a"]) == [None]
    assert said and all(issubclass(w.category, TierWarning) for w in said)
    for w in said:
        _no_secret(str(w.message))
    guarded.start()


def test_a_password_from_the_environment_opens_the_store(guarded, monkeypatch):
    """The secret out of the spec altogether (``${NAME}``, read when the tier
    opens): the store serves, and neither the spec nor the tier shows it."""
    monkeypatch.setenv("KVARENA_TEST_REDIS_PW", SECRET)
    text = f"redis://:${{KVARENA_TEST_REDIS_PW}}@127.0.0.1:{guarded.port}/0"
    spec = TierSpec.parse(text)
    tier = spec.open()
    assert tier.put_many([TierObject("b", (b"y" * 32,), 32)]).refused == []
    assert bytes(tier.get_many(["b"])[0]) == b"y" * 32
    _no_secret(str(spec) + tier.describe())
    stat = _kvarena("tiers", "stat", text, "--json")
    assert stat.returncode == 0, stat.stderr
    assert ":***@127.0.0.1" in json.loads(stat.stdout)["tier"]  # it connected
    _no_secret(stat.stdout + stat.stderr)


def test_a_wrong_password_is_refused_without_showing_either(guarded):
    wrong = guarded.url.replace(guarded.url.split("@")[0], "redis://:n0t-it")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        tier = TierSpec.parse(wrong).open()
        assert tier.get_many(["a"]) == [None]
    text = " ".join(str(w.message) for w in said) + tier.describe()
    _no_secret(text)
    assert "n0t-it" not in text and ":***@" in text
    bad = "redis://:s3cret@127.0.0.1:6379/0?socket_timeout=soon"
    with pytest.raises(TierError) as exc:  # a URL redis-py refuses
        TierSpec.parse(bad).open()
    assert "s3cret" not in str(exc.value) and ":***@" in str(exc.value)


def _kvarena(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvarena", *args], capture_output=True, text=True, timeout=120
    )


def test_the_cli_names_the_store_without_its_password(guarded, tmp_path):
    table = _kvarena("tiers", "stat", guarded.url)
    assert table.returncode == 0, table.stderr
    as_json = _kvarena("tiers", "stat", guarded.url, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert ":***@127.0.0.1" in json.loads(as_json.stdout)["tier"]
    trace = tmp_path / "one.jsonl"
    trace.write_text('{"tokens": [1, 2, 3], "output_length": 1}\n')
    replay = _kvarena("replay", str(trace), "--tier", guarded.url, "--json")
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["tiers"] == [redacted(guarded.url)]
    guarded.stop()
    gone = _kvarena("tiers", "stat", guarded.url)
    assert gone.returncode == 2 and "cannot reach the store" in gone.stderr
    for r in (table, as_json, replay, gone):
        _no_secret(r.stdout + r.stderr)
    guarded.start()
