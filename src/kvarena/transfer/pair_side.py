"""One side of a local prefill/decode pair: the commands its process serves.

A side owns a cache from a plan, its NIXL endpoint and a sender or a
receiver; :mod:`kvarena.transfer.local_pair` runs each side in its own
process and drives it over a pipe. Buffers start filled with a sentinel so
the decode side can prove that no byte outside a request's allocation was
written.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..errors import Error
from ..layout import field_extents
from ..pools import CachePlan, UnifiedCache
from .receiver import DecodeReceiver
from .sender import PrefillSender, Shipment
from .service import PrefillClient

SENTINEL = 0xA5
IDLE_POLL_S = 0.005
"""An idle side progresses NIXL this often (a command wakes it at once): cheap
enough that an idle agent costs about 1% of a core."""


class HarnessError(Error, RuntimeError):
    """A side process failed, or a command went to the wrong side; carries its message."""


def _pattern(seed: int, nbytes: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


class _Side:
    def __init__(self, role: str, plan: CachePlan) -> None:
        self.cache = UnifiedCache.from_plan(plan, "cpu")
        self.cache.buf.fill_(SENTINEL)
        self.ep: PrefillSender | DecodeReceiver = (
            PrefillSender("prefill", self.cache)
            if role == "prefill"
            else DecodeReceiver("decode", self.cache)
        )
        self.client: PrefillClient | None = None
        self.requests: dict[str, tuple[list[int], list[int]]] = {}  # prefill: filled requests

    @property
    def sender(self) -> PrefillSender:
        if not isinstance(self.ep, PrefillSender):
            raise HarnessError("this command is for the prefill side")
        return self.ep

    @property
    def receiver(self) -> DecodeReceiver:
        if not isinstance(self.ep, DecodeReceiver):
            raise HarnessError("this command is for the decode side")
        return self.ep

    # -- both sides -------------------------------------------------------------
    def hello(self) -> dict:
        return self.ep.hello()

    def connect(self, hello: dict) -> str:
        return self.ep.connect(hello)

    def digests(self, blocks: Sequence[int], slots: Sequence[int]) -> list[str]:
        return [_digest(self.cache.block_bytes_of(b)) for b in blocks] + [
            _digest(self.cache.slot_bytes_of(s)) for s in slots
        ]

    def stats(self) -> dict:
        b, s = self.cache.blocks, self.cache.slots
        pending = getattr(self.ep, "pending", [])
        return {
            "free_blocks": b.num_free,
            "live_blocks": b.num_live,
            "free_slots": s.num_free,
            "live_slots": s.num_live,
            "pending": pending,
            "quarantined": getattr(self.ep, "quarantined", []),
            "in_flight": self.ep.in_flight,
        }

    # -- prefill ----------------------------------------------------------------
    def fill(self, request: str, num_blocks: int, seed: int) -> dict:
        """Allocate and pattern a request's blocks and first state slot."""
        blocks = self.cache.blocks.allocate(num_blocks)
        slots = list(self.cache.allocate_slots(request)[:1])
        for i, b in enumerate(blocks):
            self.cache.block_bytes_of(b).copy_(_pattern(seed + i, self.cache.block_bytes))
        for s in slots:
            self.cache.slot_bytes_of(s).copy_(_pattern(seed + 10**6, self.cache.slot_bytes))
        self.requests[request] = (blocks, slots)
        return {"blocks": blocks, "slots": slots, "digests": self.digests(blocks, slots)}

    def _route(self, request: str, dst: dict) -> tuple[tuple, dict]:
        """The sender's arguments for a filled request and an ``expect`` answer:
        ``post`` and ``ship`` take the same ones."""
        from ..transfer.geometry import CacheGeometry

        blocks, slots = self.requests[request]
        geometry = CacheGeometry.from_dict(dst["geometry"])
        return (blocks, slots, dst["blocks"], dst["slots"], geometry), {"transfer": dst["transfer"]}

    def _post(self, peer: str, request: str, dst: dict, timeout_s: float) -> Shipment:
        """Post a filled request's WRITE into ``dst`` (an ``expect`` answer), not waiting."""
        args, kwargs = self._route(request, dst)
        return self.sender.post(peer, request, *args, **kwargs, timeout_s=timeout_s)

    def ship(self, peer: str, request: str, dst: dict, timeout_s: float) -> dict:
        blocks, _ = self.requests[request]
        before = [self.cache.blocks.refcount(b) for b in blocks]
        args, kwargs = self._route(request, dst)
        # The blocking road (post + check with back-off).
        result = self.sender.ship(peer, request, *args, **kwargs, timeout_s=timeout_s)
        assert [self.cache.blocks.refcount(b) for b in blocks] == before  # pins released
        return {
            "descriptors": result.descriptors,
            "nbytes": result.nbytes,
            "seconds": result.seconds,
        }

    def bench(self, peer: str, request: str, dst: dict, rounds: int) -> dict:
        """Time three transfers of one request's bytes, interleaved round by round.

        ``kvarena``: the request's descriptors (one per block run, one per slot)
        over the prepped lists; ``per_layer``: the same ranges cut the way a
        per-layer-per-tensor registration cuts them (one descriptor per layer per
        field per block run, one per layer per state field); ``raw``: one
        descriptor over the same number of bytes.
        """
        from ..transfer.descriptors import plan_request

        args, kwargs = self._route(request, dst)
        blocks, slots, _, _, geo_dst = args
        plan = plan_request(self.ep.geometry(), geo_dst, blocks, dst["blocks"], slots, dst["slots"])
        page_pieces = sum(f.layers for f in self.cache.page_fields)
        local_rows, remote_rows = [], []
        n_runs = plan.count - len(slots)
        for i in range(n_runs):
            (la, length), (ra, _) = plan.local[i].tolist(), plan.remote[i].tolist()
            cuts = [length * k // page_pieces for k in range(page_pieces + 1)]
            for lo, hi in itertools.pairwise(cuts):
                local_rows.append((la + lo, hi - lo, 0))
                remote_rows.append((ra + lo, hi - lo, 0))
        for i in range(n_runs, plan.count):
            la, ra = int(plan.local[i][0]), int(plan.remote[i][0])
            for ext in field_extents(self.cache.state_fields):
                per = ext.field.bytes_per_layer
                for layer in range(ext.field.layers):
                    at = ext.start + layer * per
                    local_rows.append((la + at, per, 0))
                    remote_rows.append((ra + at, per, 0))
        total = plan.nbytes
        raw_local = [(self.ep.geometry().base, total, 0)]
        raw_remote = [(geo_dst.base, total, 0)]
        agent, mem = self.ep.agent, self.ep.mem_type

        def post(local, remote) -> None:
            h = agent.initialize_xfer(
                "WRITE", agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, mem), peer
            )
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            agent.release_xfer_handle(h)
            if state != "DONE":
                raise HarnessError(f"benchmark transfer ended in {state}")

        methods = {
            "kvarena": lambda: self.sender.ship(peer, request, *args, **kwargs),
            "per_layer": lambda: post(local_rows, remote_rows),
            "raw": lambda: post(raw_local, raw_remote),
        }
        times: dict[str, list[float]] = {k: [] for k in methods}
        for fn in methods.values():
            fn()  # warm-up: connection and registration caches
        for _ in range(rounds):
            for name, fn in methods.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        return {
            "descriptors": {"kvarena": plan.count, "per_layer": len(local_rows), "raw": 1},
            "nbytes": {"kvarena": total, "per_layer": sum(r[1] for r in local_rows), "raw": total},
            "seconds": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
        }

    def load(self, peer: str, dsts: dict[str, dict], in_flight: int) -> dict:
        """Ship every filled request named in ``dsts`` with up to ``in_flight``
        WRITEs posted at once; each request's latency runs from its post to its
        completion. Returns requests/s, bytes and the latencies (seconds)."""
        order = list(dsts)
        running: list[tuple[str, Any, float]] = []
        latencies: list[float] = []
        nbytes = 0
        start = time.perf_counter()
        while order or running:
            while order and len(running) < in_flight:
                request = order.pop(0)
                shipment = self._post(peer, request, dsts[request], 30.0)
                running.append((request, shipment, time.perf_counter()))
            still = []
            for request, shipment, posted in running:
                if self.sender.check(shipment):
                    latencies.append(time.perf_counter() - posted)
                    nbytes += shipment.result.nbytes
                else:
                    still.append((request, shipment, posted))
            running = still
        seconds = time.perf_counter() - start
        return {
            "requests": len(latencies),
            "seconds": seconds,
            "nbytes": nbytes,
            "latencies": latencies,
        }

    def abort(self, peer: str, request: str, transfer: int) -> None:
        self.sender.abort(peer, request, transfer)

    def tcp_connect(self, endpoint: str) -> str:
        """Reach a decode service over its ZeroMQ control channel."""
        self.client = PrefillClient(self.sender, endpoint)
        return self.client.connect()

    def tcp_expect(self, request: str) -> dict:
        """Have the decode service allocate for a filled request, without shipping it."""
        if self.client is None:
            raise HarnessError("tcp_connect first")
        return self.client.expect(request, len(self.requests[request][0]))

    def tcp_close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def tcp_ship(self, request: str) -> dict:
        """Ship a filled request through the control channel; wait until the decode side has it."""
        if self.client is None:
            raise HarnessError("tcp_connect first")
        blocks, slots = self.requests[request]
        result = self.client.ship(request, blocks, slots)
        self.client.wait_ready(request)
        return {"descriptors": result.descriptors, "nbytes": result.nbytes}

    def ready_digests(self, request: str) -> list[str]:
        p = self.receiver.ready[request]
        return self.digests(p.blocks, p.slots[:1])

    def offer(self, request: str, timeout_s: float) -> dict:
        """Pull mode, prefill side: pin a filled request for the peer to READ."""
        blocks, slots = self.requests[request]
        return self.sender.offer(request, blocks, slots, timeout_s=timeout_s)

    def offers(self) -> dict:
        """Pull mode, prefill side: offers still pinned and offers released so far."""
        self.sender.poll()
        return {"offered": self.sender.offered, "released": list(self.sender.released)}

    def pull(self, peer: str, request: str, src: dict, timeout_s: float) -> dict:
        """Pull mode, decode side: READ an offered request into its allocation."""
        result = self.receiver.pull(peer, request, src, timeout_s=timeout_s)
        p = self.receiver.ready[request]
        return {"descriptors": result.descriptors, "digests": self.digests(p.blocks, p.slots[:1])}

    def refcounts(self, request: str) -> list[int]:
        return [self.cache.blocks.refcount(b) for b in self.requests[request][0]]

    # -- decode -----------------------------------------------------------------
    def expect(
        self, request: str, num_blocks: int, timeout_s: float, peer: str | None = None
    ) -> dict:
        return self.receiver.expect(request, num_blocks, timeout_s=timeout_s, peer=peer)

    def drop_peer(self, peer: str) -> list[Hashable]:
        return self.receiver.drop_peer(peer)

    def fragment(self, n: int) -> None:
        """Leave every other one of the next ``2n`` blocks taken by someone else,
        so the next ``n`` blocks allocated are pairwise non-adjacent."""
        blocks = self.cache.blocks.allocate(2 * n)
        for b in blocks[::2]:
            self.cache.blocks.release(b)

    def wait(self, request: str, timeout_s: float) -> dict:
        p = self.receiver.wait(request, timeout_s)
        return {"digests": self.digests(p.blocks, p.slots[:1])}

    def wait_all(self, requests: list[str], timeout_s: float) -> list[list[str]]:
        """Each request's digests once ready (one command for a whole batch)."""
        return [self.wait(r, timeout_s)["digests"] for r in requests]

    def untouched(self) -> bool:
        """Every byte outside the pending and ready requests' entries still holds the sentinel."""
        mask = torch.ones(self.cache.buf.numel(), dtype=torch.bool)
        held = list(self.receiver.ready.values()) + list(self.receiver.held_pending())
        for p in held:
            for b in p.blocks:
                o = b * self.cache.block_stride
                mask[o : o + self.cache.block_bytes] = False
            for s in p.slots:
                o = self.cache.slot_base + s * self.cache.slot_stride
                mask[o : o + self.cache.slot_stride] = False
        return bool((self.cache.buf[mask] == SENTINEL).all())

    def poll(self) -> dict:
        """Everything the receiver has seen so far: ready, failed and refused requests."""
        r = self.receiver
        r.poll()
        return {
            "ready": sorted(r.ready),
            "failed": list(r.failed),
            "refused": list(r.refused),
            "quarantined": r.quarantined,
        }

    def finish(self, request: str) -> None:
        self.receiver.finish(request)
