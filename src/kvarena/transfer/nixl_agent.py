"""Prefill -> decode transfer of blocks and request states over NIXL.

Each side wraps one NIXL agent (UCX backend, no progress thread: it would spin
a core while idle, so the passive side polls instead) and registers its
unified cache's whole buffer ONCE. At connect time each side prepares one
descriptor list per peer covering every block id and slot id the buffer can
hold; shipping a request is then one ``make_prepped_xfer`` over index lists:
one entry per block and per state slot, which NIXL merges where consecutive
on both sides. Push mode WRITEs from the prefill side and notifies the decode
side with the request id; pull mode READs from the decode side and notifies
the prefill side, which then releases the request's pinned blocks.

Before any byte moves the two sides compare :class:`CacheGeometry` (layout
fingerprints, entry sizes) and refuse on a mismatch, naming the field; every
descriptor is bounds-checked by :func:`plan_request` before it is posted.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..checks import check_timeout
from ..errors import Error, InvalidValueError, LayoutMismatchError
from ..pools import UnifiedCache
from .descriptors import plan_request
from .geometry import CacheGeometry

EVENT_HISTORY = 1024
"""How many past failures and refused notifications a receiver remembers."""


class TransferError(Error, RuntimeError):
    """A transfer that failed; nothing of it may be used."""


class TransferTimeout(TransferError):
    """A transfer (or an awaited one) that did not finish in time."""


def nixl_available() -> bool:
    try:
        import nixl_cu12._api  # noqa: F401
    except ImportError:
        return False
    return True


def _nixl():
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise TransferError(
            "NIXL is not installed; install kvarena's transfer extra (pip install 'kvarena[transfer]')"
        ) from exc
    return nixl_agent, nixl_agent_config


@dataclass(kw_only=True)
class _Peer:
    name: str
    geometry: CacheGeometry
    local_prep: object
    remote_prep: object


class NixlEndpoint:
    """One side of a transfer: a NIXL agent over a unified cache's buffer."""

    def __init__(self, name: str, cache: UnifiedCache) -> None:
        if cache.buf.device.type not in ("cpu", "cuda"):
            raise InvalidValueError(f"NIXL registers CPU or CUDA memory, not {cache.buf.device}")
        # A system libibverbs makes UCX's IB module crash NIXL processes at
        # exit; loopback and TCP never need it. UCX reads this when the agent
        # starts, so a caller's own setting wins.
        os.environ.setdefault("UCX_MODULES", "^ib")
        nixl_agent, nixl_agent_config = _nixl()
        if not isinstance(name, str) or not name or "#" in name:
            raise InvalidValueError(
                f"an endpoint name is a non-empty str without '#', got {name!r}"
            )
        self.name = name
        # The agent's name on the wire is unique per process instance: a second
        # process under the same name, or a restarted one, is another agent
        # rather than a clash with the one its peers still know.
        self.agent_name = f"{name}#{os.getpid()}.{secrets.token_hex(4)}"
        self.cache = cache
        self.mem_type = "DRAM" if cache.buf.device.type == "cpu" else "VRAM"
        config = nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]
        )
        self.agent = nixl_agent(self.agent_name, config)
        self._reg = self.agent.register_memory([cache.buf])
        self._peers: dict[str, _Peer] = {}

    def geometry(self) -> CacheGeometry:
        return CacheGeometry.of(self.cache)

    def hello(self) -> dict:
        """What the peer needs: NIXL metadata and this cache's geometry."""
        return {
            "name": self.name,
            "metadata": self.agent.get_agent_metadata(),
            "geometry": self.geometry().to_dict(),
        }

    def _all_rows(self, g: CacheGeometry) -> np.ndarray:
        """One row per block id the buffer can hold, then one per slot id."""
        blocks = np.arange(g.max_blocks, dtype=np.uint64)
        slots = np.arange(g.total_slots, dtype=np.uint64)
        rows = np.zeros((g.max_blocks + g.total_slots, 3), dtype=np.uint64)
        rows[: g.max_blocks, 0] = g.base + g.block_offset(blocks)
        rows[: g.max_blocks, 1] = g.block_bytes
        rows[g.max_blocks :, 0] = g.base + g.slot_offset(slots)
        rows[g.max_blocks :, 1] = g.slot_bytes
        return rows

    def connect(self, hello: dict) -> str:
        """Accept a peer after checking its layout; prepare descriptor lists once."""
        theirs = CacheGeometry.from_dict(hello["geometry"])
        problems = self.geometry().mismatches(theirs)
        if problems:
            raise LayoutMismatchError(
                f"peer {hello['name']!r} refused, layouts differ: " + "; ".join(problems)
            )
        name = self.agent.add_remote_agent(hello["metadata"])
        name = name.decode() if isinstance(name, bytes) else name
        local_prep = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._all_rows(self.geometry()), self.mem_type
        )
        remote_prep = self.agent.prep_xfer_dlist(name, self._all_rows(theirs), self.mem_type)
        self._peers[name] = _Peer(
            name=name, geometry=theirs, local_prep=local_prep, remote_prep=remote_prep
        )
        return name

    def progress(self) -> dict[str, list[bytes]]:
        """Drive this agent's worker and collect notifications (the passive side must poll)."""
        return self.agent.get_new_notifs()

    def _post(
        self,
        op: str,
        peer: str,
        request: str,
        local: tuple[Sequence[int], Sequence[int]],
        remote: tuple[Sequence[int], Sequence[int]],
        notif: bytes,
        timeout_s: float,
    ) -> float:
        """One prepped transfer of (blocks, slots) index lists; seconds it took.

        Raises :class:`TransferError` (or :class:`TransferTimeout`) on any
        failure, NIXL's own errors included; the handle is always released.
        """
        p = self._peers.get(peer)
        if p is None:
            raise TransferError(f"no connected peer {peer!r}; connected: {sorted(self._peers)}")

        def indices(g: CacheGeometry, ids: tuple[Sequence[int], Sequence[int]]) -> np.ndarray:
            blocks, slots = (np.asarray(list(x), np.int64) for x in ids)
            return np.concatenate([blocks, g.max_blocks + slots]).astype(np.int32)

        start = time.perf_counter()
        handle = None
        try:
            handle = self.agent.make_prepped_xfer(
                op,
                p.local_prep,
                indices(self.geometry(), local),
                p.remote_prep,
                indices(p.geometry, remote),
                notif_msg=notif,
            )
            state = self.agent.transfer(handle)
            pause = 20e-6
            while state == "PROC":
                if time.perf_counter() > start + timeout_s:
                    raise TransferTimeout(
                        f"request {request!r}: {op} with {peer!r} not done after {timeout_s}s"
                    )
                # Back off (20 us doubling to 1 ms): a waiting sender costs next to
                # no CPU, and a short transfer still completes within microseconds.
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(
                    f"request {request!r}: {op} with {peer!r} ended in state {state!r}"
                )
        except TransferError:
            raise
        except Exception as exc:  # NIXL's own errors, e.g. a peer that disconnected
            raise TransferError(
                f"request {request!r}: {op} with {peer!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            if handle is not None:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:
                    pass
        return time.perf_counter() - start

    def _forget(self, name: str) -> None:
        """Drop a peer: its prepared lists and NIXL's connection to it (best effort:
        a peer that died may already be gone on NIXL's side)."""
        peer = self._peers.pop(name)
        for handle in (peer.local_prep, peer.remote_prep):
            try:
                self.agent.release_dlist_handle(handle)
            except Exception:
                pass
        try:
            self.agent.remove_remote_agent(peer.name)
        except Exception:
            pass

    def close(self) -> None:
        for name in list(self._peers):
            self._forget(name)
        self.agent.deregister_memory(self._reg)


@dataclass(frozen=True, kw_only=True)
class ShipResult:
    request: str
    descriptors: int
    nbytes: int
    seconds: float


class PrefillSender(NixlEndpoint):
    """The side that holds a request's blocks and state.

    Push mode: :meth:`ship` WRITEs them into the peer. Pull mode: :meth:`offer`
    pins them and hands out their ids; the decode side READs them and its
    completion notification (``pulled:<request>``) releases the pins on the
    next :meth:`poll`.
    """

    def __init__(self, name: str, cache: UnifiedCache) -> None:
        super().__init__(name, cache)
        self._offers: dict[
            str, tuple[list[int], float]
        ] = {}  # request -> (pinned blocks, deadline)
        self.released: list[str] = []  # offers whose pins are gone: pulled or expired

    def ship(
        self,
        peer: str,
        request: str,
        src_blocks: Sequence[int],
        src_slots: Sequence[int],
        dst_blocks: Sequence[int],
        dst_slots: Sequence[int],
        dst_geometry: CacheGeometry,
        *,
        timeout_s: float = 30.0,
    ) -> ShipResult:
        """Write the request's blocks and slots into the peer's; notify with the request id.

        The source blocks are pinned (one more reference) until the transfer
        ends, successfully or not. On failure or timeout the transfer handle
        is released and :class:`TransferError` raised.
        """
        timeout_s = check_timeout(timeout_s, "ship: timeout_s")
        plan = plan_request(
            self.geometry(), dst_geometry, src_blocks, dst_blocks, src_slots, dst_slots
        )
        self.cache.slots.check_held(src_slots, "ship: source slots")
        pins = self.cache.blocks.pin(src_blocks, "ship: source blocks")
        try:
            seconds = self._post(
                "WRITE",
                peer,
                request,
                (src_blocks, src_slots),
                (dst_blocks, dst_slots),
                request.encode(),
                timeout_s,
            )
        finally:
            for b in pins:
                self.cache.blocks.release(b)
        return ShipResult(
            request=request, descriptors=plan.count, nbytes=plan.nbytes, seconds=seconds
        )

    def offer(
        self, request: str, blocks: Sequence[int], slots: Sequence[int], *, timeout_s: float = 30.0
    ) -> dict:
        """Pin a request's blocks for a peer to READ; returns the ids and this geometry."""
        timeout_s = check_timeout(timeout_s, "offer: timeout_s")
        if request in self._offers:
            raise InvalidValueError(f"request {request!r} is already offered")
        slot_ids = self.cache.slots.check_held(slots, "offer: slots").tolist()
        pins = self.cache.blocks.pin(blocks, "offer: blocks")
        self._offers[request] = (pins, time.monotonic() + timeout_s)
        return {"blocks": pins, "slots": slot_ids, "geometry": self.geometry().to_dict()}

    def poll(self) -> list[str]:
        """Release the pins of offers the peer has read, or that expired; return them."""
        done = []
        for msgs in self.progress().values():
            for msg in msgs:
                text = msg.decode(errors="replace")
                if text.startswith("pulled:") and text[7:] in self._offers:
                    done.append(text[7:])
        now = time.monotonic()
        done += [r for r, (_, deadline) in self._offers.items() if now > deadline and r not in done]
        for request in done:
            for b in self._offers.pop(request)[0]:
                self.cache.blocks.release(b)
        self.released.extend(done)
        return done

    @property
    def offered(self) -> list[str]:
        return sorted(self._offers)


@dataclass
class _Pending:
    blocks: list[int]
    slots: tuple[int, ...]
    deadline: float


@dataclass
class ReceiverEvents:
    ready: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


class DecodeReceiver(NixlEndpoint):
    """The side that allocates destinations for expected requests and waits for them."""

    def __init__(self, name: str, cache: UnifiedCache) -> None:
        super().__init__(name, cache)
        self._pending: dict[str, _Pending] = {}
        self.ready: dict[str, _Pending] = {}
        # The latest failures (with their reasons) and refused notifications: bounded,
        # so a long-running receiver's memory does not grow with its history.
        self.failed: deque[tuple[str, str]] = deque(maxlen=EVENT_HISTORY)
        self.refused: deque[str] = deque(maxlen=EVENT_HISTORY)

    def expect(
        self, request: str, num_blocks: int, *, with_state: bool = True, timeout_s: float = 30.0
    ) -> dict:
        """Allocate ``num_blocks`` blocks (and the request's state slots) for ``request``.

        Returns what the sender needs: destination ids and this side's current
        geometry. Refused (nothing allocated) when the pools cannot hold it.
        """
        timeout_s = check_timeout(timeout_s, "expect: timeout_s")
        if request in self._pending or request in self.ready:
            raise InvalidValueError(f"request {request!r} is already expected")
        blocks = self.cache.blocks.allocate(num_blocks)
        try:
            slots = self.cache.allocate_state(request) if with_state else ()
        except Exception:
            for b in blocks:
                self.cache.blocks.release(b)
            raise
        self._pending[request] = _Pending(blocks, tuple(slots), time.monotonic() + timeout_s)
        # The request's first slot receives the shipped state; rollback copies stay local.
        return {"blocks": blocks, "slots": list(slots[:1]), "geometry": self.geometry().to_dict()}

    def pull(self, peer: str, request: str, src: dict, *, timeout_s: float = 30.0) -> ShipResult:
        """READ an offered request (``src`` from the peer's :meth:`PrefillSender.offer`)
        into this request's allocation; it is ready when this returns.

        The completion notification tells the peer to release its pins. On
        failure the allocation is freed and :class:`TransferError` raised.
        """
        timeout_s = check_timeout(timeout_s, "pull: timeout_s")
        p = self._pending.get(request)
        if p is None:
            raise InvalidValueError(f"request {request!r} is not expected; call expect() first")
        dst_slots = list(p.slots[: len(src["slots"])])
        plan = plan_request(
            CacheGeometry.from_dict(src["geometry"]),
            self.geometry(),
            src["blocks"],
            p.blocks,
            src["slots"],
            dst_slots,
        )
        try:
            seconds = self._post(
                "READ",
                peer,
                request,
                (p.blocks, dst_slots),
                (src["blocks"], src["slots"]),
                f"pulled:{request}".encode(),
                timeout_s,
            )
        except TransferError as exc:
            self._free(self._pending.pop(request), request)
            self.failed.append((request, str(exc)))
            raise
        self.ready[request] = self._pending.pop(request)
        return ShipResult(
            request=request, descriptors=plan.count, nbytes=plan.nbytes, seconds=seconds
        )

    def _free(self, p: _Pending, request: Hashable) -> None:
        for b in p.blocks:
            self.cache.blocks.release(b)
        if p.slots:
            self.cache.free_state(request)

    def poll(self) -> ReceiverEvents:
        """Progress NIXL, mark notified requests ready, fail the ones past their deadline."""
        events = ReceiverEvents()
        for msgs in self.progress().values():
            for msg in msgs:
                request = msg.decode(errors="replace")
                p = self._pending.pop(request, None)
                if p is None:
                    events.refused.append(request)  # nobody asked for it: never marked ready
                    continue
                self.ready[request] = p
                events.ready.append(request)
        now = time.monotonic()
        for request in [r for r, p in self._pending.items() if now > p.deadline]:
            self._free(self._pending.pop(request), request)
            events.failed.append(
                (request, "timed out waiting for the transfer; its blocks and slots were freed")
            )
        self.failed.extend(events.failed)
        self.refused.extend(events.refused)
        return events

    def wait(self, request: str, timeout_s: float) -> _Pending:
        """Poll until ``request`` is ready; raise :class:`TransferTimeout` otherwise."""
        timeout_s = check_timeout(timeout_s, "wait: timeout_s")
        deadline = time.monotonic() + timeout_s
        while request not in self.ready:
            self.poll()
            for failed, reason in self.failed:
                if failed == request:
                    raise TransferTimeout(f"request {request!r}: {reason}")
            if time.monotonic() > deadline:
                raise TransferTimeout(f"request {request!r} not ready after {timeout_s}s")
            time.sleep(0.0002)
        return self.ready[request]

    def finish(self, request: str) -> None:
        """The engine is done with a ready request: free its blocks and slots."""
        self._free(self.ready.pop(request), request)

    def held_pending(self) -> list[_Pending]:
        """Allocations of requests still awaiting their transfer."""
        return list(self._pending.values())

    @property
    def pending(self) -> list[str]:
        return sorted(self._pending)
