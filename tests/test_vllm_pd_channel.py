"""The prefill engine's side channel over real ZeroMQ sockets on loopback, and
its book of held requests. Runs in the ``.venv-vllm`` environment."""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("vllm")

import msgspec  # vLLM's dependencies, as the connector's
import zmq

from kvarena.integrations.vllm.pd_channel import (
    Asker,
    Channel,
    ChannelError,
    Hello,
    OfferBook,
)

HELLOS = {
    r: Hello(rank=r, agent=bytes([r]) * 8, table={"bases": [], "kinds": {}}, namespace=b"ns")
    for r in range(2)
}


def ask(port: int, message: dict) -> dict:
    """One ask through the decode scheduler's client, its answer awaited here."""
    asker = Asker()
    try:
        asked = asker.send("127.0.0.1", port, message)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            got = asker.answers()
            if asked in got:
                return got[asked]
            time.sleep(0.005)
        raise AssertionError(f"no answer to {message}")
    finally:
        asker.close()


@pytest.fixture()
def channel():
    book = OfferBook()
    ch = Channel(host="127.0.0.1", port=0, engine_id="e1", hellos=HELLOS, offers=book)
    try:
        yield ch, book
    finally:
        ch.close()


def test_hellos_by_rank_and_refusals_naming_why(channel):
    ch, _ = channel
    for r in range(2):
        got = ask(ch.port, {"op": "hello", "engine_id": "e1", "rank": r})
        assert Hello.from_dict(got["hello"]) == HELLOS[r] and got["tp_size"] == 2
    for message, why in (
        ({"op": "hello", "engine_id": "e1", "rank": 2}, "no rank 2"),
        ({"op": "hello", "engine_id": "e2", "rank": 0}, "this is engine e1"),
        ({"op": "write", "engine_id": "e1"}, "unknown op"),
    ):
        got = ask(ch.port, message)
        assert got["ok"] is False and why in got["why"]


def test_a_malformed_ask_costs_its_asker_an_answer_not_the_channel(channel):
    ch, _ = channel
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{ch.port}")
    sock.send(b"\xc1 not msgpack")
    answer = msgspec.msgpack.decode(sock.recv())
    sock.close()
    assert answer["ok"] is False and "malformed" in answer["why"]
    assert ask(ch.port, {"op": "hello", "engine_id": "e1", "rank": 0})["ok"]


def test_a_lease_outlasts_the_hold_and_a_release_ends_it(channel):
    ch, book = channel
    book.hold("r1", 0.0)  # expired at once, unless leased first
    lease = {"op": "lease", "engine_id": "e1", "request": "r1", "seconds": 60}
    assert ask(ch.port, lease)["ok"]
    assert book.expired() == [] and len(book) == 1  # a reader may still be reading
    ask(ch.port, {"op": "release", "engine_id": "e1", "request": "r1"})
    assert book.expired() == ["r1"] and len(book) == 0
    late = ask(ch.port, lease)  # too late: the read is refused
    assert late["ok"] is False and "not held" in late["why"]
    book.hold("r2", 60.0)
    book.release({"r2"})  # read: vLLM freed it
    assert len(book) == 0 and book.expired() == []


def test_a_taken_port_is_refused_at_start(channel):
    ch, book = channel
    with pytest.raises(ChannelError, match=f"cannot listen on 127.0.0.1:{ch.port}"):
        Channel(host="127.0.0.1", port=ch.port, engine_id="e2", hellos=HELLOS, offers=book)


def test_an_asker_never_waits_and_matches_answers_by_id(channel):
    ch, book = channel
    book.hold("r1", 60.0)
    asker = Asker()
    try:
        ids = [
            asker.send("127.0.0.1", ch.port, {"op": "lease", "engine_id": "e1", "request": r})
            for r in ("r1", "r2")
        ]
        ids.append(asker.send("127.0.0.1", ch.port, {"op": "hello", "engine_id": "e1", "rank": 1}))
        got: dict = {}
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:  # answers come on later calls
            got.update(asker.answers())
            time.sleep(0.01)
        assert [got[i]["ok"] for i in ids] == [True, False, True]
        assert Hello.from_dict(got[ids[2]]["hello"]) == HELLOS[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = s.getsockname()[1]
        lost = asker.send("127.0.0.1", dead, {"op": "hello", "engine_id": "e1", "rank": 0})
        assert lost not in asker.answers()  # nobody there: never answered, never waited for
    finally:
        asker.close()
