"""The decode side: allocates for expected requests, takes what lands, quarantines what may still land."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from ..checks import check_timeout
from ..errors import InvalidValueError
from ..pools import Holding, UnifiedCache
from .descriptors import plan_request
from .endpoint import (
    EVENT_HISTORY,
    WAIT_BACKOFF_MAX_S,
    NixlEndpoint,
    ShipResult,
    TransferError,
    TransferTimeout,
)
from .geometry import CacheGeometry
from .wire import PULLED, encode_request, in_order, parse_notification


def _check_offer(src: object) -> dict:
    """An offer from :meth:`PrefillSender.offer` as the peer sent it: its ids and geometry."""
    missing = [
        k for k in ("blocks", "slots", "geometry") if not isinstance(src, dict) or k not in src
    ]
    if missing:
        raise InvalidValueError(
            f"pull: the offer must be the dict PrefillSender.offer returned (blocks, slots, "
            f"geometry); missing {missing}"
        )
    if not isinstance(src["geometry"], dict):  # type: ignore[index]
        raise InvalidValueError("pull: the offer's geometry must be CacheGeometry.to_dict()")
    return src  # type: ignore[return-value]


@dataclass
class _Pending:
    blocks: list[int]
    slots: tuple[int, ...]
    deadline: float
    transfer: int = 0  # this attempt's id: its notifications must carry it
    peer: str | None = None  # who will write it, where known
    owner: Hashable = None  # the slot allocator's owner key: (request, transfer)
    holding: Holding | None = None  # the ids as the cache's one record (``blocks`` is its list)


@dataclass
class ReceiverEvents:
    ready: list[Hashable] = field(default_factory=list)
    failed: list[tuple[Hashable, str]] = field(default_factory=list)
    refused: list[Hashable] = field(default_factory=list)
    released: list[Hashable] = field(default_factory=list)  # quarantined allocations freed


class DecodeReceiver(NixlEndpoint):
    """The side that allocates destinations for expected requests and waits for them.

    The rule it keeps: **a block or slot that a peer may still write is never
    handed to another request.** Every expected request is one *transfer* with
    its own id; the sender's notifications carry it, so a late notification of
    an earlier attempt is refused, never taken for the current one. A request
    whose deadline passes is *quarantined*, not freed: its blocks and slots stay
    held until no write of that transfer can land — its WRITE's own completion
    notification arrives late, the sender's abort notification arrives (sent
    once NIXL cancelled the write or it ended), or the engine drops a peer it
    knows is dead (:meth:`drop_peer`). An abort that arrives before the
    deadline frees the request at once.
    """

    def __init__(self, name: str, cache: UnifiedCache) -> None:
        super().__init__(name, cache)
        self._pending: dict[Hashable, _Pending] = {}
        self.ready: dict[Hashable, _Pending] = {}
        self._quarantine: dict[int, tuple[Hashable, _Pending]] = {}  # transfer -> (request, held)
        self._next_transfer = 1
        # The latest failures (with their reasons) and refused notifications: bounded,
        # so a long-running receiver's memory does not grow with its history.
        self.failed: deque[tuple[Hashable, str]] = deque(maxlen=EVENT_HISTORY)
        self.refused: deque[Hashable] = deque(maxlen=EVENT_HISTORY)

    def expect(
        self,
        request: Hashable,
        num_blocks: int,
        *,
        with_state: bool | None = None,
        timeout_s: float = 30.0,
        peer: str | None = None,
    ) -> dict:
        """Allocate ``num_blocks`` blocks (and the request's state slots) for ``request``.

        ``with_state=None`` takes state slots when the cache has STATE fields.

        Returns what the sender needs: destination ids, this side's current
        geometry and the transfer id its WRITE must carry. Refused (nothing
        allocated) when the pools cannot hold it. ``peer`` (the writer's agent
        name) lets :meth:`drop_peer` free a quarantine of this request.
        """
        timeout_s = check_timeout(timeout_s, "expect: timeout_s")
        encode_request(request)  # its notification must decode to this very id
        if peer is not None and (not isinstance(peer, str) or not peer):
            raise InvalidValueError(
                f"expect: peer must be an agent name (a str) or None, got {peer!r}"
            )
        if request in self._pending or request in self.ready:
            raise InvalidValueError(f"request {request!r} is already expected")
        transfer = self._next_transfer
        owner = (request, transfer)
        blocks = self.cache.blocks.allocate(num_blocks)
        try:
            if with_state is None:
                with_state = bool(self.cache.state_fields)
            slots = self.cache.allocate_slots(owner) if with_state else ()
        except Exception:
            for b in blocks:
                self.cache.blocks.release(b)
            raise
        self._next_transfer += 1
        # Fixed while the peer may write them: a boundary move must not relocate
        # ids whose bytes arrive by address.
        holding = self.cache.hold(owner, blocks, fixed=True)
        self._pending[request] = _Pending(
            blocks, tuple(slots), time.monotonic() + timeout_s, transfer, peer, owner, holding
        )
        # The request's first slot receives the shipped state; rollback copies stay local.
        return {
            "blocks": blocks,
            "slots": list(slots[:1]),
            "geometry": self.geometry().to_dict(),
            "transfer": transfer,
        }

    def pull(
        self, peer: str, request: Hashable, src: dict, *, timeout_s: float = 30.0
    ) -> ShipResult:
        """READ an offered request (``src`` from the peer's :meth:`PrefillSender.offer`)
        into this request's allocation; it is ready when this returns.

        The completion notification tells the peer to release its pins. On
        failure :class:`TransferError` is raised and the allocation is freed once
        the READ is cancelled (quarantined until then).
        """
        timeout_s = check_timeout(timeout_s, "pull: timeout_s")
        src = _check_offer(src)
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
        self._pending.pop(request)
        self._quarantine[p.transfer] = (request, p)
        try:
            seconds = self._post(
                "READ",
                peer,
                request,
                (p.blocks, dst_slots),
                (src["blocks"], src["slots"]),
                (PULLED + encode_request(request)).encode(),
                timeout_s,
                on_settled=lambda: self._release_quietly(p.transfer),
            )
        except TransferError as exc:
            self.failed.append((request, str(exc)))
            raise
        del self._quarantine[p.transfer]
        self._landed(p)
        self.ready[request] = p
        return ShipResult(
            request=request, descriptors=plan.count, nbytes=plan.nbytes, seconds=seconds
        )

    def _landed(self, p: _Pending) -> None:
        """Every byte of ``p`` is here: its ids may move with the boundary now."""
        if p.holding is not None:
            p.holding.fixed = False

    def _free(self, p: _Pending) -> None:
        for b in p.blocks:
            self.cache.blocks.release(b)
        if p.slots:
            self.cache.release_slots(p.owner)
        if p.holding is not None:
            self.cache.let_go(p.holding)
            p.holding = None

    def _release(self, transfer: int) -> Hashable | None:
        """Free a quarantined allocation: no write of its transfer can land now."""
        held = self._quarantine.pop(transfer, None)
        if held is None:
            return None
        self._free(held[1])
        return held[0]

    def cancel(self, transfer: int) -> Hashable | None:
        """Free ``transfer``'s allocation now, pending or quarantined: its sender
        never received the destination (its expect went unanswered), so no byte
        of it can ever be written. The request freed, None if none is held."""
        released = self._release(transfer)
        if released is not None:
            return released
        for request, p in self._pending.items():
            if p.transfer == transfer:
                del self._pending[request]
                self._free(p)
                self.failed.append((request, "cancelled: its sender never got the destination"))
                return request
        return None

    def _release_quietly(self, transfer: int) -> None:
        self._release(transfer)

    def poll(self) -> ReceiverEvents:
        """Progress NIXL; mark notified requests ready, free what aborts and late
        completions release, quarantine the requests past their deadline."""
        events = ReceiverEvents()
        for msgs in self.progress().values():
            for msg in msgs:
                parsed = parse_notification(msg)
                if parsed is None:
                    events.refused.append(msg.decode(errors="replace"))
                    continue
                kind, transfer, request = parsed
                released = self._release(transfer)
                if released is not None:
                    events.released.append(released)
                    continue
                p = self._pending.get(request)
                if p is None or p.transfer != transfer:
                    events.refused.append(request)  # not this attempt: never marked ready
                    continue
                del self._pending[request]
                if kind == "w":
                    self._landed(p)
                    self.ready[request] = p
                    events.ready.append(request)
                else:  # the sender gave up and nothing of its write can land: free now
                    self._free(p)
                    events.failed.append((request, "aborted by the sender"))
        now = time.monotonic()
        for request in [r for r, p in self._pending.items() if now > p.deadline]:
            p = self._pending.pop(request)
            self._quarantine[p.transfer] = (request, p)
            events.failed.append(
                (
                    request,
                    "timed out waiting for the transfer; its blocks and slots stay quarantined "
                    "until the sender aborts, the late write completes, or the peer is dropped",
                )
            )
        self.failed.extend(events.failed)
        self.refused.extend(events.refused)
        return events

    def drop_peer(self, peer: str) -> list[Hashable]:
        """``peer``'s process is gone: forget it, and free every allocation it could
        have written — its quarantines and its still-pending requests (those fail,
        "peer gone"); the requests freed.

        Only for a peer whose process is known to be gone (the liveness link to it
        closed: see :class:`~kvarena.transfer.service.DecodeService`): dropping
        does not stop a live writer — measured with NIXL's UCX backend, a WRITE a
        live sender posts after the receiver removed it still lands, notification
        and all (tests/test_transfer.py). A stopped (SIGSTOP) sender is alive: its
        quarantines wait for its abort or its late completion.
        """
        if peer in self._peers:
            self._forget(peer)
        freed = []
        for transfer, (request, p) in list(self._quarantine.items()):
            if p.peer == peer:
                self._release(transfer)
                freed.append(request)
        for request, p in list(self._pending.items()):
            if p.peer == peer:
                self._free(self._pending.pop(request))
                self.failed.append((request, f"peer {peer!r} is gone; nothing of it can land"))
                freed.append(request)
        return freed

    def wait(self, request: Hashable, timeout_s: float) -> _Pending:
        """Poll until ``request`` is ready; raise :class:`TransferTimeout` otherwise."""
        timeout_s = check_timeout(timeout_s, "wait: timeout_s")
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while request not in self.ready:
            events = self.poll()
            for failed, reason in events.failed:
                if failed == request:
                    raise TransferTimeout(f"request {request!r}: {reason}")
            if request not in self._pending and request not in self.ready:
                reasons = [r for q, r in self.failed if q == request]
                raise TransferTimeout(
                    f"request {request!r}: {reasons[-1] if reasons else 'not expected here'}"
                )
            if time.monotonic() > deadline:
                raise TransferTimeout(f"request {request!r} not ready after {timeout_s}s")
            time.sleep(pause)  # back off: a waiting receiver costs next to no CPU
            pause = min(pause * 2, WAIT_BACKOFF_MAX_S)
        return self.ready[request]

    def finish(self, request: Hashable) -> None:
        """The engine is done with a ready request: free its blocks and slots."""
        try:
            p = self.ready.pop(request)
        except KeyError:
            raise InvalidValueError(f"request {request!r} is not ready") from None
        self._free(p)

    def take(self, request: Hashable) -> tuple[list[int], tuple[int, ...], Hashable]:
        """The engine takes a ready request over: ``(blocks, slots, owner)`` are
        now its to free (``cache.blocks.release`` each block,
        ``cache.release_slots(owner)``); the receiver forgets them."""
        try:
            p = self.ready.pop(request)
        except KeyError:
            raise InvalidValueError(f"request {request!r} is not ready") from None
        if p.holding is not None:
            self.cache.let_go(p.holding)  # the engine holds them from here, in its own record
        return list(p.blocks), self.cache.slots.held_by(p.owner), p.owner

    def held_pending(self) -> list[_Pending]:
        """Allocations a peer may still write: awaited requests and quarantined ones."""
        return list(self._pending.values()) + [p for _, p in self._quarantine.values()]

    @property
    def pending(self) -> list[Hashable]:
        return in_order(self._pending)

    @property
    def quarantined(self) -> list[Hashable]:
        """Requests whose allocation waits for proof that no write can land."""
        return in_order(r for r, _ in self._quarantine.values())
