"""Two real processes on loopback, NIXL's UCX backend, byte-exact on both sides."""

import math
import multiprocessing as mp
import os
import random
import signal
import time

import pytest
import torch
from conftest import plan_for

from kvarena import EntryField
from kvarena.transfer import nixl_available
from kvarena.transfer.local_pair import HarnessError, SideProcess, connect_pair, ship_request

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL (kvarena[transfer]) not installed"
)


def random_spec(seed: int, total: int = 6 << 20):
    rng = random.Random(seed)
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.uint8]
    page = tuple(
        EntryField(
            f"p{i}",
            rng.randint(1, 3),
            (rng.choice([8, 16]), rng.randint(1, 4), rng.choice([32, 64, 100])),
            rng.choice(dtypes),
        )
        for i in range(rng.randint(1, 3))
    )
    state = tuple(
        EntryField(
            f"s{i}",
            rng.randint(1, 4),
            (rng.randint(1, 8), rng.randint(1, 300)),
            rng.choice(dtypes),
            align=rng.choice([0, 0, 512]),
            in_checkpoint=rng.random() < 0.8,
        )
        for i in range(rng.randint(1, 3))
    )
    score = EntryField("score", 1, (16,), torch.float32, fill=-math.inf)
    return plan_for(page, (*state, score), total, max_seqs=6)


@pytest.fixture
def pair(request):
    """A prefill and a decode process; always stopped, exit codes checked."""
    env = getattr(request, "param", {})
    spec = random_spec(7)
    procs = [SideProcess("prefill", spec, env), SideProcess("decode", spec, env)]
    yield (*procs, spec)
    codes = [p.stop() for p in procs if p.process.exitcode is None or p.process.is_alive()]
    assert all(code in (0, None) or code < 0 for code in codes)
    assert not [p for p in mp.active_children() if p.name.startswith("kvarena-")]


@pytest.mark.parametrize(
    "pair", [{"UCX_TLS": "cma,tcp"}, {"UCX_TLS": "tcp"}], indirect=True, ids=["cma,tcp", "tcp"]
)
def test_requests_arrive_byte_exact_and_nothing_else_is_written(pair):
    prefill, decode, _ = pair
    peer, _ = connect_pair(prefill, decode)
    rng = random.Random(3)
    for i in range(4):
        result = ship_request(prefill, decode, peer, f"req-{i}", rng.randint(1, 9), seed=100 * i)
        assert result["byte_exact"], i
        assert result["descriptors"] <= len(result["src"]["blocks"]) + 1
    assert decode.call("untouched")
    for i in range(4):
        decode.call("finish", f"req-{i}")
    stats = decode.call("stats")
    assert stats["live_blocks"] == 0 and stats["live_slots"] == 0 and not stats["pending"]
    assert prefill.stop() == 0 and decode.stop() == 0


def test_random_layouts_on_both_sides():
    for seed in (11, 12):
        spec = random_spec(seed)
        prefill, decode = SideProcess("prefill", spec), SideProcess("decode", spec)
        try:
            peer, _ = connect_pair(prefill, decode)
            assert ship_request(prefill, decode, peer, "r", 5, seed)["byte_exact"]
            assert decode.call("untouched")
        finally:
            assert prefill.stop() == 0 and decode.stop() == 0


def test_fingerprint_mismatch_is_refused_before_any_byte_moves():
    spec = random_spec(7)
    other = plan_for(spec.page_fields, spec.state_fields[:-1], spec.budget_bytes, spec.max_seqs)
    prefill, decode = SideProcess("prefill", spec), SideProcess("decode", other)
    try:
        with pytest.raises(RuntimeError, match=r"LayoutMismatchError.*state_fingerprint"):
            prefill.call("connect", decode.call("hello"))
        assert decode.call("untouched")
    finally:
        assert prefill.stop() == 0 and decode.stop() == 0


def test_unexpected_request_is_refused_and_others_are_unaffected(pair):
    prefill, decode, _ = pair
    peer, prefill_name = connect_pair(prefill, decode)
    assert ship_request(prefill, decode, peer, "good", 3, 1)["byte_exact"]
    # "ghost" was never expected: the sender borrows another request's ids.
    src = prefill.call("fill", "ghost", 2, 5)
    dst = decode.call("expect", "victim", 2, 1.0, prefill_name)
    prefill.call("ship", peer, "ghost", dst, 10.0)
    # The notification may trail the sender's DONE; poll until it shows.
    seen = _poll_until(decode, lambda s: "ghost" in s["refused"], "the ghost refused")
    assert (
        "ghost" in seen["refused"]
        and "ghost" not in seen["ready"]
        and "victim" not in seen["ready"]
    )
    assert src["blocks"]
    # The victim was never notified: it times out, and its blocks and slots stay
    # quarantined (its peer might still write them) until that peer is dropped.
    with pytest.raises(RuntimeError, match="TransferTimeout"):
        decode.call("wait", "victim", 5.0)
    stats = decode.call("stats")
    assert stats["pending"] == [] and stats["quarantined"] == ["victim"]
    assert stats["live_blocks"] == 3 + 2 and stats["live_slots"] == 2
    assert decode.call("drop_peer", prefill_name) == ["victim"]
    stats = decode.call("stats")
    assert (
        stats["quarantined"] == [] and stats["live_blocks"] == 3 and stats["live_slots"] == 1
    )  # only "good"


def test_killed_decode_fails_cleanly_and_releases_pins(pair):
    prefill, decode, _ = pair
    peer, _ = connect_pair(prefill, decode)
    assert ship_request(prefill, decode, peer, "before", 2, 9)["byte_exact"]
    prefill.call("fill", "doomed", 4, 3)
    dst = decode.call("expect", "doomed", 4, 30.0)
    decode.kill()
    with pytest.raises(RuntimeError, match=r"TransferError|TransferTimeout"):
        prefill.call("ship", peer, "doomed", dst, 5.0)
    assert prefill.call("refcounts", "doomed") == [1, 1, 1, 1]  # the transfer's pins are gone


def test_killed_prefill_frees_the_waiting_request(pair):
    prefill, decode, _ = pair
    peer, prefill_name = connect_pair(prefill, decode)
    assert ship_request(prefill, decode, peer, "kept", 2, 4)["byte_exact"]
    prefill.call("fill", "orphan", 3, 8)
    decode.call("expect", "orphan", 3, 1.0, prefill_name)
    prefill.kill()
    with pytest.raises(RuntimeError, match="TransferTimeout"):
        decode.call("wait", "orphan", 5.0)
    # Quarantined, not freed, until the dead peer is dropped: then nothing of it can land.
    assert decode.call("stats")["quarantined"] == ["orphan"]
    assert decode.call("drop_peer", prefill_name) == ["orphan"]
    stats = decode.call("stats")
    assert (
        stats["pending"] == [] and stats["live_blocks"] == 2 and stats["live_slots"] == 1
    )  # "kept" only
    decode.call("finish", "kept")
    stats = decode.call("stats")
    assert stats["live_blocks"] == 0 and stats["live_slots"] == 0


def test_tcp_control_channel_between_a_prefill_client_and_a_decode_service():
    spec = random_spec(21)
    decode = SideProcess("decode-service", spec)
    prefill = SideProcess("prefill", spec)
    try:
        assert decode.endpoint.startswith("tcp://127.0.0.1:")
        assert prefill.call("tcp_connect", decode.endpoint).startswith("decode#")
        for i, n in enumerate((3, 1, 6)):
            src = prefill.call("fill", f"r{i}", n, 50 + i)
            shipped = prefill.call("tcp_ship", f"r{i}")
            assert shipped["descriptors"] <= n + 1
            assert decode.call("ready_digests", f"r{i}") == src["digests"]
        assert decode.call("untouched")
    finally:
        assert prefill.stop() == 0 and decode.stop() == 0


def test_tcp_control_channel_refuses_a_mismatched_layout():
    spec = random_spec(21)
    other = plan_for(spec.page_fields, spec.state_fields[:-1], spec.budget_bytes, spec.max_seqs)
    decode = SideProcess("decode-service", spec)
    prefill = SideProcess("prefill", other)
    try:
        with pytest.raises(RuntimeError, match="state_fingerprint"):
            prefill.call("tcp_connect", decode.endpoint)
    finally:
        assert prefill.stop() == 0 and decode.stop() == 0


def test_pull_mode_reads_byte_exact_and_releases_the_offer(pair):
    prefill, decode, _ = pair
    _, prefill_at_decode = connect_pair(prefill, decode)
    src = prefill.call("fill", "pulled", 5, 77)
    dst = decode.call("expect", "pulled", 5, 30.0)
    offer = prefill.call("offer", "pulled", 30.0)
    assert prefill.call("refcounts", "pulled") == [2] * 5  # pinned while offered
    got = decode.call("pull", prefill_at_decode, "pulled", offer, 30.0)
    assert got["digests"] == src["digests"] and got["descriptors"] <= 6
    assert dst["blocks"] and decode.call("untouched")
    offers = _until(
        lambda: prefill.call("offers"), lambda o: "pulled" in o["released"], "pulled released"
    )
    assert offers["offered"] == [] and prefill.call("refcounts", "pulled") == [1] * 5


def test_an_offer_nobody_pulls_expires_and_unpins(pair):
    prefill, decode, _ = pair
    connect_pair(prefill, decode)
    prefill.call("fill", "stale", 3, 1)
    prefill.call("offer", "stale", 0.001)  # expired once the sender next looks
    offers = _until(
        lambda: prefill.call("offers"), lambda o: "stale" in o["released"], "stale released"
    )
    assert offers["released"] == ["stale"] and offers["offered"] == []
    assert prefill.call("refcounts", "stale") == [1, 1, 1]


def test_expect_beyond_the_pools_is_refused_and_allocates_nothing(pair):
    prefill, decode, _ = pair
    connect_pair(prefill, decode)
    before = decode.call("stats")
    with pytest.raises(RuntimeError, match="BlockAllocationError"):
        decode.call("expect", "huge", before["free_blocks"] + 1, 5.0)
    for i in range(before["free_slots"]):
        decode.call("expect", f"s{i}", 1, 30.0)
    with pytest.raises(RuntimeError, match="StateAllocationError"):
        decode.call("expect", "one-too-many", 1, 5.0)
    after = decode.call("stats")
    assert after["live_blocks"] == before["free_slots"] and after["free_slots"] == 0


def test_disaggregated_example_runs():
    import pathlib
    import subprocess
    import sys

    example = pathlib.Path(__file__).parent.parent / "examples" / "disaggregated.py"
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "byte-exact on the decode side: True" in done.stdout


def test_pinning_is_all_or_nothing():
    from kvarena import PrefillSender, UnifiedCache
    from kvarena.transfer import CacheGeometry

    cache = UnifiedCache.from_plan(random_spec(5), "cpu")
    live = cache.blocks.allocate(3)
    cache.blocks.release(live[2])  # one source block is no longer held
    slot = cache.allocate_slots("r")[0]
    sender = PrefillSender(f"pin-test-{os.getpid()}", cache)
    try:
        geometry = CacheGeometry.of(cache)
        for call in (
            lambda: sender.offer("r", live, [slot]),
            lambda: sender.ship("peer", "r", live, [slot], [7, 8, 9], [slot], geometry, transfer=1),
        ):
            with pytest.raises(ValueError, match=f"block {live[2]} is free"):
                call()
            assert [cache.blocks.refcount(b) for b in live] == [1, 1, 0]
        with pytest.raises(ValueError, match=r"slot \d+ is free"):
            sender.offer("r", live[:2], [slot - 1])
        assert [cache.blocks.refcount(b) for b in live] == [1, 1, 0]
        with pytest.raises(ValueError, match="timeout_s"):
            sender.offer("r", live[:2], [slot], timeout_s=0)
        assert sender.offered == []
    finally:
        sender.close()


def test_a_client_recovers_after_a_silent_service():
    import json
    import threading

    import zmq

    from kvarena import TransferTimeout
    from kvarena.transfer.service import PrefillClient
    from kvarena.transfer.wire import decode_request

    ctx = zmq.Context()
    service = ctx.socket(zmq.ROUTER)
    service.setsockopt(zmq.LINGER, 0)
    port = service.bind_to_random_port("tcp://127.0.0.1")
    client = PrefillClient(None, f"tcp://127.0.0.1:{port}", timeout_s=0.3)  # type: ignore[arg-type]
    try:
        with pytest.raises(TransferTimeout, match="did not answer 'status'"):
            client.status("r")  # the service reads nothing: no answer

        # The service answers from now on; the client's next calls must work (a stuck
        # request/reply socket would refuse every later send).
        def serve_until(wanted: str) -> None:
            while True:
                ident, _, raw = service.recv_multipart()
                got = decode_request(json.loads(raw)["request"])  # ids cross tagged
                service.send_multipart([ident, b"", json.dumps({"status": got}).encode()])
                if got == wanted:
                    return

        for request in ("a", "b"):
            t = threading.Thread(target=serve_until, args=(request,))
            t.start()
            assert client.status(request) == {"status": request}
            t.join(timeout=5)
    finally:
        client.close()
        service.close()
        ctx.term()


def test_one_name_twice_and_a_restarted_peer_are_new_agents():
    spec = random_spec(9)
    decode = SideProcess("decode", spec)
    first, second = SideProcess("prefill", spec), SideProcess("prefill", spec)
    try:
        peer, _ = connect_pair(first, decode)
        assert connect_pair(second, decode)[0] == peer  # one decode agent for both
        for i, side in enumerate((first, second)):
            assert ship_request(side, decode, peer, f"r{i}", 3, seed=i)["byte_exact"]
        # The decode side restarts under its name: reachable again, as a new agent.
        assert decode.stop() == 0
        decode = SideProcess("decode", spec)
        again, _ = connect_pair(first, decode)
        assert again != peer and again.startswith("decode#")
        assert ship_request(first, decode, again, "again", 2, seed=9)["byte_exact"]
    finally:
        for side in (first, second, decode):
            if side.process.is_alive():
                side.stop()


def _until(ask, done, what: str):
    """``ask()`` until ``done(answer)``, then the answer: a wait for something
    that will happen, bounded at 20 s for a broken build (never a race: no
    test's outcome depends on how soon it happens)."""
    deadline = time.monotonic() + 20
    while not done(answer := ask()):
        assert time.monotonic() < deadline, f"never saw {what}: {answer}"
        time.sleep(0.01)
    return answer


def _poll_until(decode, done, what: str) -> dict:
    """Poll the decode side until ``done(seen)``."""
    return _until(lambda: decode.call("poll"), done, what)


def _settled(prefill) -> None:
    """Poll the sender until no transfer is in flight (each poll settles some)."""
    _until(
        lambda: (prefill.call("offers"), prefill.call("stats"))[1],
        lambda s: not s["in_flight"],
        "no transfer in flight",
    )


def test_a_late_write_never_lands_in_another_requests_blocks(pair):
    """The decode side times A out; B is expected next; A's WRITE arrives after B is
    ready. A's blocks were quarantined, not handed to B, so B keeps its bytes."""
    prefill, decode, _ = pair
    peer, prefill_name = connect_pair(prefill, decode)
    src_a = prefill.call("fill", "A", 3, 11)
    src_b = prefill.call("fill", "B", 3, 22)
    dst_a = decode.call("expect", "A", 3, 0.05, prefill_name)
    _poll_until(decode, lambda s: "A" in s["quarantined"], "A quarantined")
    dst_b = decode.call("expect", "B", 3, 30.0, prefill_name)
    assert not set(dst_a["blocks"]) & set(dst_b["blocks"])  # A's blocks are still held
    assert dst_b["transfer"] != dst_a["transfer"]
    prefill.call("ship", peer, "B", dst_b, 30.0)
    assert decode.call("wait", "B", 30.0)["digests"] == src_b["digests"]
    assert decode.call("untouched")  # nothing outside B's and quarantined A's bytes moved
    prefill.call("ship", peer, "A", dst_a, 30.0)  # the late write lands where A was
    seen = _poll_until(decode, lambda s: not s["quarantined"], "A's quarantine released")
    assert "A" not in seen["ready"]
    assert decode.call("ready_digests", "B") == src_b["digests"] != src_a["digests"]
    decode.call("finish", "B")
    stats = decode.call("stats")
    assert stats["live_blocks"] == 0 and stats["live_slots"] == 0  # nothing leaked


def test_a_retry_is_never_made_ready_by_an_earlier_attempts_write(pair):
    prefill, decode, _ = pair
    peer, prefill_name = connect_pair(prefill, decode)
    src = prefill.call("fill", "R", 2, 33)
    first = decode.call("expect", "R", 2, 0.05, prefill_name)
    _poll_until(decode, lambda s: "R" in s["quarantined"], "R quarantined")
    retry = decode.call("expect", "R", 2, 30.0, prefill_name)  # the same request, again
    prefill.call("ship", peer, "R", first, 30.0)  # the first attempt's write, late
    seen = _poll_until(decode, lambda s: not s["quarantined"], "the first attempt released")
    assert "R" not in seen["ready"] and decode.call("stats")["pending"] == ["R"]
    prefill.call("ship", peer, "R", retry, 30.0)
    assert decode.call("wait", "R", 30.0)["digests"] == src["digests"]
    decode.call("finish", "R")
    assert decode.call("stats")["live_blocks"] == 0


def test_a_sender_that_gives_up_frees_the_receiver_at_once(pair):
    prefill, decode, _ = pair
    peer, prefill_name = connect_pair(prefill, decode)
    prefill.call("fill", "G", 4, 44)
    dst = decode.call("expect", "G", 4, 3600.0, prefill_name)  # a deadline far away
    assert decode.call("stats")["live_blocks"] == 4
    prefill.call("abort", peer, "G", dst["transfer"])
    seen = _poll_until(decode, lambda s: any(r == "G" for r, _ in s["failed"]), "G aborted")
    assert ("G", "aborted by the sender") in seen["failed"]
    stats = decode.call("stats")
    assert stats["live_blocks"] == 0 and stats["live_slots"] == 0 and stats["pending"] == []
    with pytest.raises(RuntimeError, match="aborted by the sender"):
        decode.call("wait", "G", 1.0)


def test_dropping_a_live_peer_does_not_stop_its_writes(pair):
    """Why drop_peer is only for dead peers: NIXL keeps delivering a live sender's
    WRITE after the receiver removed it. If this ever changes, the fault model in
    the README (quarantines of a stopped sender wait for it) can be relaxed."""
    prefill, decode, _ = pair
    peer, prefill_name = connect_pair(prefill, decode)
    src = prefill.call("fill", "D", 2, 55)
    dst = decode.call("expect", "D", 2, 3600.0)  # no writer named: dropping frees nothing
    assert decode.call("drop_peer", prefill_name) == []
    prefill.call("ship", peer, "D", dst, 30.0)
    assert decode.call("wait", "D", 30.0)["digests"] == src["digests"]


def _drain_stream(decode, srcs: dict, fate: str) -> dict:
    """Wait for every shipped request; each one is ready byte-exact or failed with
    a typed error (``fate`` names the one the fault hit). Returns the outcomes."""
    outcome = {}
    for request, src in srcs.items():
        try:
            got = decode.call("wait", request, 20.0)
        except HarnessError as exc:
            assert "TransferTimeout" in str(exc), exc  # typed, never a raw NIXL error
            assert request == fate, f"{request} failed though the fault hit {fate}"
            outcome[request] = "failed"
            continue
        assert got["digests"] == src["digests"], f"{request} is not byte-exact"
        outcome[request] = "ready"
    return outcome


@pytest.mark.parametrize("point", ["before", "posted", "after"])
def test_a_prefill_killed_mid_stream(pair, point):
    """Kill -9 of the prefill at a chosen point of a stream of requests: every
    request is byte-exact or failed (typed), nothing leaks once the dead peer is
    dropped, and the decode side serves a restarted prefill. Killed before the
    fated request was posted it must fail, after its ship returned it must be
    ready; killed while it may be in flight, either outcome is checked whole."""
    prefill, decode, spec = pair
    peer, prefill_name = connect_pair(prefill, decode)
    n, kill_at = 6, 3
    srcs = {}
    for i in range(n):
        request = f"s{i}"
        srcs[request] = prefill.call("fill", request, 3, 100 * i)
        dst = decode.call("expect", request, 3, 2.0, prefill_name)
        if i < kill_at:
            prefill.call("ship", peer, request, dst, 30.0)
            continue
        if point == "posted":
            prefill.post("ship", peer, request, dst, 30.0)  # in flight, or not yet, or done
        elif point == "after":
            prefill.call("ship", peer, request, dst, 30.0)
        prefill.kill()
        break
    fate = f"s{kill_at}"
    outcome = _drain_stream(decode, {r: s for r, s in srcs.items() if r <= fate}, fate)
    assert all(outcome[f"s{i}"] == "ready" for i in range(kill_at))
    want = {"before": {"failed"}, "after": {"ready"}, "posted": {"ready", "failed"}}[point]
    assert outcome[fate] in want, (point, outcome[fate])
    if outcome[fate] == "ready":  # byte-exact (checked by the drain); nothing quarantined
        assert decode.call("stats")["quarantined"] == []
    else:
        assert decode.call("stats")["quarantined"] == [fate]
        assert decode.call("drop_peer", prefill_name) == [fate]  # the process is gone
    for request, state in outcome.items():
        if state == "ready":
            decode.call("finish", request)
    stats = decode.call("stats")
    assert (stats["live_blocks"], stats["live_slots"], stats["pending"], stats["quarantined"]) == (
        0,
        0,
        [],
        [],
    )
    # The survivor serves a restarted prefill under the same name.
    again = SideProcess("prefill", spec)
    try:
        peer2, _ = connect_pair(again, decode)
        assert ship_request(again, decode, peer2, "after", 2, 7)["byte_exact"]
    finally:
        assert again.stop() == 0


@pytest.mark.parametrize("seed", [1, 2])
def test_a_decode_killed_mid_stream(pair, seed):
    """Kill -9 of the decode side mid-stream: the prefill's ship fails typed, its
    pins come back, and it ships byte-exact to a restarted decode side."""
    rng = random.Random(seed)
    prefill, decode, spec = pair
    peer, _ = connect_pair(prefill, decode)
    n, kill_at = 5, rng.randrange(5)
    for i in range(n):
        request = f"d{i}"
        prefill.call("fill", request, 3, 10 * i)
        dst = decode.call("expect", request, 3, 30.0)
        if i == kill_at:
            decode.kill()
            with pytest.raises(HarnessError, match=r"TransferError|TransferTimeout"):
                prefill.call("ship", peer, request, dst, 3.0)
            break
        prefill.call("ship", peer, request, dst, 30.0)
        decode.call("wait", request, 30.0)
    # Every pin comes back (a transfer NIXL could not cancel settles on a poll).
    _settled(prefill)
    for i in range(kill_at + 1):
        assert prefill.call("refcounts", f"d{i}") == [1, 1, 1]
    fresh = SideProcess("decode", spec)
    try:
        peer2, _ = connect_pair(prefill, fresh)
        src = prefill.call("fill", "later", 2, 77)
        dst = fresh.call("expect", "later", 2, 30.0)
        prefill.call("ship", peer2, "later", dst, 30.0)
        assert fresh.call("wait", "later", 30.0)["digests"] == src["digests"]
        assert fresh.call("untouched")
    finally:
        assert fresh.stop() == 0


def test_a_sender_stopped_past_the_deadline_and_resumed(pair):
    """The prefill is stopped before it can write A, so A's deadline passes for
    certain: the receiver quarantines A's blocks (a write may still land) and
    serves the next request in other blocks; SIGCONT: the late write lands in
    the quarantine, which is then released, and A is never served."""
    prefill, decode, _ = pair
    peer, prefill_name = connect_pair(prefill, decode)
    prefill.call("fill", "A", 4, 1)
    src_b = prefill.call("fill", "B", 4, 2)
    dst_a = decode.call("expect", "A", 4, 0.2, prefill_name)
    os.kill(prefill.process.pid, signal.SIGSTOP)
    try:
        prefill.post("ship", peer, "A", dst_a, 30.0)  # runs after SIGCONT, past the deadline
        _poll_until(decode, lambda s: "A" in s["quarantined"], "A quarantined")
        dst_b = decode.call("expect", "B", 4, 30.0, prefill_name)
        assert not set(dst_a["blocks"]) & set(dst_b["blocks"])
        # While the sender is stopped, the receiver still works: nothing it
        # holds for A is handed out, and B waits.
        assert decode.call("stats")["pending"] == ["B"]
    finally:
        os.kill(prefill.process.pid, signal.SIGCONT)
    prefill.result("ship")  # A's WRITE, after the resume, into the quarantine
    prefill.call("ship", peer, "B", dst_b, 30.0)
    assert decode.call("wait", "B", 30.0)["digests"] == src_b["digests"]
    _poll_until(decode, lambda s: not s["quarantined"], "A's quarantine released")
    assert "A" not in decode.call("poll")["ready"]  # past its deadline: never served
    decode.call("finish", "B")
    stats = decode.call("stats")
    assert stats["live_blocks"] == 0 and stats["live_slots"] == 0


def test_many_writes_in_flight_are_each_byte_exact(pair):
    prefill, decode, _ = pair
    peer, prefill_name = connect_pair(prefill, decode)
    names = [f"m{i}" for i in range(5)]
    srcs = {n: prefill.call("fill", n, 2, 300 + i) for i, n in enumerate(names)}
    dsts = {n: decode.call("expect", n, 2, 60.0, prefill_name) for n in names}
    r = prefill.call("load", peer, dsts, 3)  # up to three WRITEs posted at once
    assert r["requests"] == 5 and len(r["latencies"]) == 5
    assert decode.call("wait_all", names, 60.0) == [srcs[n]["digests"] for n in names]
    assert [prefill.call("refcounts", n) for n in names] == [[1, 1]] * 5  # pins back
    assert decode.call("untouched")


def _stats_until(side, done, what: str) -> dict:
    return _until(lambda: side.call("stats"), done, what)


def test_the_liveness_link_frees_a_killed_senders_allocations_and_not_a_stopped_ones():
    """Over the TCP control channel: a prefill's requests expected but not written
    stay held while the prefill is stopped (it might still write), and are freed
    within moments of its death (the kernel closes its link)."""
    spec = random_spec(23)
    decode = SideProcess("decode-service", spec)
    prefill = SideProcess("prefill", spec)
    try:
        prefill.call("tcp_connect", decode.endpoint)
        prefill.call("fill", "x", 3, 1)
        prefill.call("fill", "y", 2, 2)
        prefill.call("tcp_expect", "x")
        prefill.call("tcp_expect", "y")
        held = decode.call("stats")
        assert held["pending"] == ["x", "y"] and held["live_blocks"] == 5
        os.kill(prefill.process.pid, signal.SIGSTOP)
        try:
            # The service looks at its links between any two commands it answers:
            # after these it has seen all a stopped sender's link shows (nothing:
            # the link stays open), and nothing is freed.
            for _ in range(3):
                assert decode.call("stats")["live_blocks"] == 5
        finally:
            os.kill(prefill.process.pid, signal.SIGCONT)
        prefill.kill()
        stats = _stats_until(decode, lambda s: s["live_blocks"] == 0, "the dead peer dropped")
        assert stats["pending"] == [] and stats["live_slots"] == 0
        # The survivor serves a restarted prefill.
        again = SideProcess("prefill", spec)
        try:
            again.call("tcp_connect", decode.endpoint)
            src = again.call("fill", "z", 2, 3)
            again.call("tcp_ship", "z")
            assert decode.call("ready_digests", "z") == src["digests"]
            again.call("tcp_close")  # a clean close settles first, then ends the link
        finally:
            assert again.stop() == 0
    finally:
        if prefill.process.is_alive():
            prefill.stop()
        assert decode.stop() == 0


def test_a_refused_ship_frees_the_receiver_at_once(pair):
    """A ship refused before a byte moved (here: destination ids outside the
    receiver's pool) tells the receiver, which frees the allocation at once."""
    prefill, decode, _ = pair
    peer, prefill_name = connect_pair(prefill, decode)
    prefill.call("fill", "bad", 2, 9)
    dst = decode.call("expect", "bad", 2, 3600.0, prefill_name)
    wrong = {**dst, "blocks": [10**6, 10**6 + 1]}
    with pytest.raises(HarnessError, match="Error"):
        prefill.call("ship", peer, "bad", wrong, 30.0)
    seen = _poll_until(decode, lambda s: any(r == "bad" for r, _ in s["failed"]), "bad aborted")
    assert ("bad", "aborted by the sender") in seen["failed"]
    stats = decode.call("stats")
    assert stats["live_blocks"] == 0 and stats["live_slots"] == 0
    assert prefill.call("refcounts", "bad") == [1, 1]


def test_a_decode_side_stopped_mid_stream_and_resumed(pair):
    """SIGSTOP the decode side while the prefill ships: each WRITE completes or
    fails typed; after SIGCONT every request is byte-exact or freed, and both
    sides hold nothing more (pins back, no pending, no quarantine)."""
    prefill, decode, _ = pair
    peer, prefill_name = connect_pair(prefill, decode)
    names = [f"t{i}" for i in range(3)]
    srcs = {n: prefill.call("fill", n, 3, 40 + i) for i, n in enumerate(names)}
    dsts = {n: decode.call("expect", n, 3, 3600.0, prefill_name) for n in names}
    outcome = {}
    os.kill(decode.process.pid, signal.SIGSTOP)
    try:
        for n in names:
            try:
                prefill.call("ship", peer, n, dsts[n], 1.0)
                outcome[n] = "shipped"
            except HarnessError as exc:
                assert "TransferTimeout" in str(exc) or "TransferError" in str(exc), exc
                outcome[n] = "failed"
    finally:
        os.kill(decode.process.pid, signal.SIGCONT)
    _settled(prefill)  # uncancelled WRITEs settle (and abort)
    # Shipped: ready and exact. Failed: aborted (freed) or completed late, never torn.
    seen = _poll_until(
        decode,
        lambda s: (
            not s["quarantined"]
            and all(n in s["ready"] or any(r == n for r, _ in s["failed"]) for n in names)
        ),
        "every request settled",
    )
    for n in names:
        if n in seen["ready"]:
            assert decode.call("ready_digests", n) == srcs[n]["digests"]
            decode.call("finish", n)
        else:
            assert outcome[n] == "failed"
    stats = decode.call("stats")
    assert (stats["live_blocks"], stats["pending"], stats["quarantined"]) == (0, [], [])
    assert [prefill.call("refcounts", n) for n in names] == [[1, 1, 1]] * 3


def test_an_expected_request_is_fixed_until_it_lands():
    """Destinations a peer writes by address are a fixed holding: a boundary move
    that would relocate them is refused while the request is pending."""
    from kvarena import BoundaryMoveError, DecodeReceiver, UnifiedCache

    cache = UnifiedCache.from_plan(random_spec(5), "cpu")
    if not cache.state_fields or not cache.page_fields:
        pytest.skip("needs both pools")
    filler = cache.blocks.allocate(cache.blocks.num_free - 2)
    receiver = DecodeReceiver(f"fixed-test-{os.getpid()}", cache)
    try:
        dst = receiver.expect("r", 2, timeout_s=60.0)
        for b in filler:
            cache.blocks.release(b)
        k = 1
        while cache.geometry.blocks_below(cache.slots.first - k) > min(dst["blocks"]):
            k += 1
        if k > cache.slots.first:
            pytest.skip("the layout leaves no room to move below the request")
        with pytest.raises(BoundaryMoveError, match="read or written by a peer"):
            cache.grow_state(k)
        assert [h.fixed for h in cache.holdings] == [True]
    finally:
        receiver.close()


def test_offered_sources_are_fixed_until_released():
    """Blocks and slots a peer may READ by address (an offer) never move under it;
    once the offer is gone they move like any others."""
    from kvarena import BoundaryMoveError, PrefillSender, UnifiedCache

    cache = UnifiedCache.from_plan(random_spec(5), "cpu")
    if not cache.state_fields or not cache.page_fields:
        pytest.skip("needs both pools")
    filler = cache.blocks.allocate(cache.blocks.num_free - 2)
    blocks = cache.blocks.allocate(2)
    slots = cache.allocate_slots("r")
    sender = PrefillSender(f"offer-fixed-{os.getpid()}", cache)
    try:
        offer = sender.offer("r", blocks, slots[:1], timeout_s=0.001)
        assert offer["blocks"] == blocks
        for b in filler:
            cache.blocks.release(b)
        k = 1
        while cache.geometry.blocks_below(cache.slots.first - k) > min(blocks):
            k += 1
        if k > cache.slots.first:
            pytest.skip("the layout leaves no room to move below the request")
        before = cache.buf.clone()
        with pytest.raises(BoundaryMoveError, match="read or written by a peer"):
            cache.grow_state(k)
        assert torch.equal(cache.buf, before) and cache.moves == 0
        _until(lambda: (sender.poll(), sender.released)[1], lambda r: "r" in r, "r released")
        assert len(cache.holdings) == 0 and [cache.blocks.refcount(b) for b in blocks] == [1, 1]
        cache.grow_state(k)  # the sources are the engine's alone again: they move
        assert cache.moves == 1
    finally:
        sender.close()


def test_expect_checks_its_peer_before_allocating():
    from kvarena import DecodeReceiver, InvalidValueError, UnifiedCache

    cache = UnifiedCache.from_plan(random_spec(5), "cpu")
    receiver = DecodeReceiver(f"door-test-{os.getpid()}", cache)
    try:
        free = cache.blocks.num_free
        for bad in (5, "", b"prefill"):
            with pytest.raises(InvalidValueError, match="peer must be an agent name"):
                receiver.expect("r", 2, peer=bad)
        assert cache.blocks.num_free == free and receiver.pending == []
    finally:
        receiver.close()


def _client(spec, endpoint: str, timeout_s: float):
    """A prefill client in this process, over a cache of its own, that drives its
    NIXL worker only inside its own calls (as an engine's idle sender does)."""
    from kvarena.pools import UnifiedCache
    from kvarena.transfer.sender import PrefillSender
    from kvarena.transfer.service import PrefillClient

    cache = UnifiedCache.from_plan(spec, "cpu")
    client = PrefillClient(PrefillSender("prefill-here", cache), endpoint, timeout_s=timeout_s)
    client.connect()
    return client


def test_an_abort_on_a_connection_that_carried_nothing_frees_the_receiver_at_once():
    """The first message on a fresh connection leaves only while the sender
    drives its worker: an abort is pushed out before it returns, so the
    receiver frees the allocation although the sender goes idle."""
    spec = random_spec(21)
    decode = SideProcess("decode-service", spec)
    try:
        client = _client(spec, decode.endpoint, 30.0)
        dst = client.expect("g", 2)
        assert decode.call("stats")["live_blocks"] == 2
        client.sender.abort(client.peer, "g", int(dst["transfer"]))
        status = _until(lambda: client.status("g"), lambda s: s["status"] != "pending", "g aborted")
        assert status == {"status": "failed", "reason": "aborted by the sender"}
        assert decode.call("stats")["live_blocks"] == 0
        client.close()
    finally:
        assert decode.stop() == 0


def test_an_expect_left_unanswered_is_cancelled_and_frees_the_receiver():
    """The decode service stalls (SIGSTOP) past the client's timeout three times:
    each expect raises, its attempt is cancelled, and once the service runs on
    it frees what it allocated for them — whichever it reads first, the expect
    or the cancel — while the client stays connected."""
    from kvarena.transfer import TransferTimeout

    spec = random_spec(21)
    decode = SideProcess("decode-service", spec)
    try:
        client = _client(spec, decode.endpoint, 1.0)
        for i in range(3):
            os.kill(decode.process.pid, signal.SIGSTOP)
            try:
                with pytest.raises(TransferTimeout):
                    client.expect(f"s{i}", 8)
            finally:
                os.kill(decode.process.pid, signal.SIGCONT)
        stats = _until(
            lambda: decode.call("stats"),
            lambda s: s["live_blocks"] == 0 and s["live_slots"] == 0,
            "the unanswered expects freed",
        )
        assert stats["pending"] == [] and stats["quarantined"] == []
        dst = client.expect("after", 2)  # the client still serves
        assert len(dst["blocks"]) == 2
        from kvarena.transfer import TransferError

        for bad in ({"op": "cancel"}, {"op": "cancel", "attempt": 7}):  # refused, named
            with pytest.raises(TransferError, match="attempt must be the non-empty string"):
                client._call(bad)
        client.close()
    finally:
        assert decode.stop() == 0
