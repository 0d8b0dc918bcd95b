"""Request ids on the wire: every id a transfer takes comes back equal and of its
type; every other id is refused where it enters, before anything is allocated."""

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_transfer import (
    pair,  # noqa: F401 (the fixture of a prefill and a decode process)
    random_spec,
)

from kvarena import DecodeReceiver, InvalidValueError, UnifiedCache
from kvarena.transfer import nixl_available
from kvarena.transfer.receiver import _check_offer
from kvarena.transfer.wire import decode_request, encode_request, notification, parse_notification

leaves = (
    st.text(max_size=20)
    | st.integers()
    | st.binary(max_size=16)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
)
ids = st.recursive(leaves, lambda inner: st.tuples(inner) | st.tuples(inner, inner), max_leaves=6)


@given(request=ids)
def test_every_id_round_trips_with_its_type(request):
    back = decode_request(encode_request(request))
    assert back == request and type(back) is type(request)
    kind, transfer, parsed = parse_notification(notification("w", 7, request))
    assert (kind, transfer, parsed) == ("w", 7, request) and type(parsed) is type(request)


def test_ints_and_strings_stay_apart():
    assert decode_request(encode_request(7)) == 7
    assert decode_request(encode_request("7")) == "7"
    assert decode_request(encode_request(True)) is True
    assert encode_request(1) != encode_request(True) != encode_request(1.0)
    assert decode_request(encode_request(1 << 200)) == 1 << 200


@pytest.mark.parametrize(
    ("request_id", "words"),
    [
        (None, "None is refused"),
        ([1, 2], "not hashable"),
        (frozenset({1}), "cannot cross a transfer"),
        (object(), "cannot cross a transfer"),
        (float("nan"), "must be finite"),
        ("x" * 5000, "at most 4,096"),
        ((((((((((1,),),),),),),),),), "nests deeper"),
    ],
)
def test_ids_that_cannot_cross_are_refused(request_id, words):
    with pytest.raises(InvalidValueError, match=words):
        encode_request(request_id)


@pytest.mark.parametrize("text", ["", "7", '"7"', '["i","x"]', '["q",1]', "[", '["t",[["s"]]]', 5])
def test_foreign_text_decodes_to_nothing(text):
    assert decode_request(text) is None


@pytest.mark.parametrize(
    "msg",
    [
        b"w:1:7",
        b"w:x:" + encode_request("a").encode(),
        b"z:1:",
        "w:１:".encode() + encode_request("a").encode(),
    ],
)
def test_foreign_notifications_are_not_parsed(msg):
    assert parse_notification(msg) is None


def test_expect_refuses_an_id_that_cannot_cross_before_allocating():
    cache = UnifiedCache.from_plan(random_spec(5), "cpu")
    receiver = DecodeReceiver(f"wire-test-{os.getpid()}", cache)
    try:
        free = cache.blocks.num_free
        for bad in (frozenset({1}), object(), None):
            with pytest.raises(InvalidValueError, match="request id"):
                receiver.expect(bad, 2)
        assert cache.blocks.num_free == free and receiver.pending == []
        dst = receiver.expect(7, 2)  # an int id is taken, and stays an int
        assert receiver.pending == [7] and dst["transfer"] >= 1
        for offer in (
            {},
            {"blocks": [], "slots": []},
            None,
            {"blocks": [], "slots": [], "geometry": None},
        ):
            with pytest.raises(InvalidValueError, match="offer"):
                receiver.pull("peer", 7, offer)
        assert receiver.pending == [7]
    finally:
        receiver.close()


def test_check_offer_names_what_is_missing():
    with pytest.raises(InvalidValueError, match=r"missing \['geometry'\]"):
        _check_offer({"blocks": [1], "slots": []})


@pytest.mark.skipif(not nixl_available(), reason="NIXL (kvarena[transfer]) not installed")
def test_ids_of_other_types_become_ready_over_a_real_transfer(pair):  # noqa: F811
    """An int and a tuple id through NIXL: each write's notification names the very
    id, so the request becomes ready (an int once arrived as "7" and waited forever)."""
    from test_transfer import connect_pair, ship_request

    prefill, decode, _ = pair
    peer, _ = connect_pair(prefill, decode)
    for request in (7, ("chat", 3), b"\x00id", "7"):
        assert ship_request(prefill, decode, peer, request, 2, seed=5)["byte_exact"], request
    assert decode.call("stats")["pending"] == []
