"""KV events for routers through the real engine and vLLM's own ZMQ publisher.

A tiny Llama with a host tier too small for its prompts (it evicts) over a
disk tier; vLLM publishes KV events (``kv_events_config``) to a real ZMQ
subscriber, which asks the publisher's replay socket for what it missed (as a
router does), decoding vLLM's msgpack schema. A router built from those events alone — vLLM's
device blocks and kvarena's tiers, by medium — must know, for every prompt,
how many of its blocks the host holds (equal to the host tier's own
contents), how many the disk holds, and so the tokens the next lookup hits
once the device cache is reset (equal to what the engine then reports).

Runs in ``.venv-vllm``; skipped where vLLM is not installed.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")

from kvarena.integrations.transformers.tiny import save_tiny  # noqa: E402
from kvarena.testing.vllm_engine import engine_args, freeze_heap  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_in_process")

BLOCK = 32


def subscriber(endpoint: str):
    """A live subscriber to every topic (a router's socket)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def received(sock) -> dict[int, bytes]:
    """What the live subscriber has received by now: payload by sequence number."""
    import zmq

    got = {}
    while sock.poll(200, zmq.POLLIN):
        _topic, seq, payload = sock.recv_multipart()
        got[int.from_bytes(seq, "big")] = payload
    return got


def replay(endpoint: str) -> list:
    """Every event batch the publisher still holds, from sequence 0, as
    ``(sequence, payload)``: what a router asks for to fill what it missed."""
    import zmq

    end = (-1).to_bytes(8, "big", signed=True)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)  # a publisher that never answers fails the test
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        batches = []
        while True:
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == end:
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)


class Router:
    """What a KV-aware router knows from the events: block hashes by medium, and
    each hash's (parent, tokens) as vLLM's device events announce them."""

    def __init__(self) -> None:
        self.held: dict[str, set] = {}
        self.chain: dict[tuple, object] = {}  # (parent hash, block tokens) -> hash
        self.removed: dict[str, int] = {}

    def apply(self, event) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if isinstance(event, BlockStored):
            self.held.setdefault(event.medium, set()).update(event.block_hashes)
            if event.medium == "GPU":
                parent, bs = event.parent_block_hash, event.block_size
                for i, h in enumerate(event.block_hashes):
                    self.chain[(parent, tuple(event.token_ids[i * bs : (i + 1) * bs]))] = h
                    parent = h
        elif isinstance(event, BlockRemoved):
            self.held.setdefault(event.medium, set()).difference_update(event.block_hashes)
            self.removed[event.medium] = self.removed.get(event.medium, 0) + 1
        elif isinstance(event, AllBlocksCleared):
            self.held.pop("GPU", None)  # vLLM's device cache reset; the tiers keep theirs

    def hashes(self, prompt: list[int]) -> list:
        """The prompt's block hashes, chained from its tokens as the router hashes them."""
        out, parent = [], None
        for i in range(len(prompt) // BLOCK):
            h = self.chain.get((parent, tuple(prompt[i * BLOCK : (i + 1) * BLOCK])))
            if h is None:
                break
            out.append(h)
            parent = h
        return out


def test_a_router_reading_the_events_knows_each_tiers_share_of_every_prompt(tmp_path):
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    from kvarena.integrations.vllm import kv_transfer_config
    from kvarena.prefix.keys import block_keys
    from kvarena.tiers.names import ImageKind, object_name

    model = save_tiny("llama", tmp_path)
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/events",
        replay_endpoint=f"ipc://{tmp_path}/replay",
    )
    # a host tier of four KV objects (~33 KB each): the prompts' ~20 blocks evict
    transfer = kv_transfer_config(["host:160KiB", f"disk:{tmp_path}/disk:64MiB"])
    freeze_heap()
    llm = LLM(
        **engine_args(model, block_size=BLOCK, distributed_executor_backend="uni"),
        kv_transfer_config=transfer,
        kv_events_config=events,
    )
    live = subscriber(events.endpoint)
    try:
        rng = random.Random(9)
        base = [rng.randrange(3, 500) for _ in range(200)]
        prompts = [base[:150], base[:64] + [rng.randrange(3, 500) for _ in range(120)], base]
        params = SamplingParams(max_tokens=4, temperature=0, detokenize=False)
        for p in prompts:
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        worker = get_kv_transfer_group()._worker
        worker.flush()  # every save written: the next step carries the report
        llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)

        # The live socket may miss the first batches (a subscription takes a moment
        # to reach the publisher); the replay fills them, and agrees with it.
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        heard = received(live)
        buffered = replay(events.replay_endpoint)
        assert heard and all(heard[seq] == payload for seq, payload in buffered if seq in heard)
        router = Router()
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        for seq, payload in buffered:
            for event in decoder.decode(heard.get(seq, payload)).events:
                router.apply(event)
        assert router.removed.get("CPU", 0) > 0  # the host evicted, and said so

        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
        host, disk = worker.tiers.tiers
        predicted, hosted = [], []
        for p in prompts:
            hashes = router.hashes(p)[: (len(p) - 1) // BLOCK]  # what a lookup may use
            keys = block_keys(sched.root, np.asarray(p[: len(hashes) * BLOCK]), BLOCK, ())
            names = [object_name(ImageKind.KV_BLOCK, k) for k in keys]
            in_host = sum(h in router.held.get("CPU", set()) for h in hashes)
            assert in_host == sum(host.contains_many(names))  # the host tier's own contents
            hosted.append(in_host)
            on_disk = [h in router.held.get("STORAGE", set()) for h in hashes]
            assert on_disk == disk.contains_many(names)
            run = 0
            while run < len(hashes) and on_disk[run]:
                run += 1
            predicted.append(run * BLOCK)
        assert any(predicted) and any(hosted), (predicted, hosted)

        llm.reset_prefix_cache()
        for p, want in zip(prompts, predicted, strict=True):
            llm.reset_prefix_cache()
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            if want < (len(p) - 1) // BLOCK * BLOCK:
                assert out.num_cached_tokens == want  # what the next lookup answers
            else:  # and a partial last block past the announced ones (no block hash of vLLM's)
                assert want <= out.num_cached_tokens <= len(p) - 1
    finally:
        live.close(linger=0)
        ensure_kv_transfer_shutdown()
        llm.llm_engine.engine_core.shutdown()


def _book_of_two_ranks(kinds: list[str], *, hash_block_size: int):
    """A KV events book of two ranks over tiers of ``kinds`` (32-token blocks, one
    attention group), and a request of 128 tokens carrying vLLM's block hashes
    (one per ``hash_block_size`` tokens: the i-th all bytes ``i``)."""
    from types import SimpleNamespace

    from kvarena.integrations.vllm.events import TierEvents

    book = TierEvents(
        tiers=[(k, k) for k in kinds],
        kv_groups=[(0, "full_attention")],
        state_groups=[],
        block_size=32,
        hash_block_size=hash_block_size,
        ranks=2,
    )
    hashes = [bytes([i]) * 32 for i in range(128 // hash_block_size)]
    return book, SimpleNamespace(
        block_hashes=hashes, all_token_ids=list(range(128)), lora_request=None
    )


def test_an_object_dropped_from_every_local_tier_is_announced_once_each_and_forgotten():

    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from kvarena.integrations.vllm.ranks import rank_names
    from kvarena.integrations.vllm.records import BlockCopy
    from kvarena.tiers.names import ImageKind, object_name

    book, request = _book_of_two_ranks(["host", "disk"], hash_block_size=16)
    copy = BlockCopy(index=1, key=bytes([9]) * 16, blocks=(4,))
    prefix = object_name(ImageKind.KV_BLOCK, copy.key)
    book.planned(request, ImageKind.KV_BLOCK, copy)
    book.stored(prefix)
    stored = book.take()
    assert [(e.medium, e.locality) for e in stored] == [("CPU", "LOCAL"), ("STORAGE", "LOCAL")]
    assert all(isinstance(e, BlockStored) for e in stored)
    # vLLM's hash of 2 blocks of 32 = its 4th hash of 16; the parent its 2nd; tokens 32..63
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as vllm_hash

    assert stored[0].block_hashes == [vllm_hash(bytes([3]) * 32)]
    assert stored[0].parent_block_hash == vllm_hash(bytes([1]) * 32)
    assert stored[0].token_ids == list(range(32, 64))
    rank1 = rank_names(prefix, 2)[1]
    book.dropped("host", [rank1])
    book.dropped("host", [rank_names(prefix, 2)[0]])  # the other rank's drop: already said
    book.dropped("disk", [rank1])
    removed = book.take()
    assert [(type(e), e.medium) for e in removed] == [
        (BlockRemoved, "CPU"),
        (BlockRemoved, "STORAGE"),
    ]
    assert not (book._held or book._prefix_of or book._removed)  # nothing kept for it


def test_an_object_a_tier_refused_is_never_announced_there():
    """A rank's tier that did not store its shard (a full disk, a store out of
    memory): before every rank saved it, the object is announced in the other
    tiers alone; after, it is announced gone from that tier, once."""

    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from kvarena.integrations.vllm.ranks import rank_names
    from kvarena.integrations.vllm.records import BlockCopy, WorkerReport
    from kvarena.tiers.names import ImageKind, object_name

    book, request = _book_of_two_ranks(["host", "disk", "redis"], hash_block_size=32)
    copies = [BlockCopy(index=i, key=bytes([9 + i]) * 16, blocks=(i,)) for i in range(2)]
    first, second = (object_name(ImageKind.KV_BLOCK, c.key) for c in copies)
    for c in copies:
        book.planned(request, ImageKind.KV_BLOCK, c)
    # rank 0 reports both saved, its disk refused the first; rank 1 later, all stored
    own0 = rank_names(first, 2)[0]
    book.reported(WorkerReport(refused=[("disk", own0, first)]), [])
    book.reported(WorkerReport(), [first, second])
    stored = book.take()
    assert all(isinstance(e, BlockStored) for e in stored)
    media = [(e.block_hashes[0], e.ownership) for e in stored]
    one, two = (request.block_hashes[i] for i in range(2))
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as vllm_hash

    assert media == [
        (vllm_hash(one), "kvarena:host"),
        (vllm_hash(one), "kvarena:redis"),
        *((vllm_hash(two), f"kvarena:{t}") for t in ("host", "disk", "redis")),
    ]
    # after both ranks announced it: a refusal (a store that ran out of memory on a
    # refresh) is a removal, said once; a drop from the refused disk says nothing more
    own1 = rank_names(second, 2)[1]
    book.reported(WorkerReport(refused=[("redis", own1, second)] * 2), [])
    book.dropped("disk", [own0])
    removed = book.take()
    assert [(type(e), e.block_hashes[0], e.ownership) for e in removed] == [
        (BlockRemoved, vllm_hash(two), "kvarena:redis")
    ]
