"""The prefill side: ships a request's blocks and slots (push), or offers them to be read (pull)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ..checks import check_int, check_timeout
from ..errors import Error, InvalidValueError
from ..pools import Holding, UnifiedCache
from .descriptors import plan_request
from .endpoint import WAIT_BACKOFF_MAX_S, NixlEndpoint, ShipResult, Xfer
from .geometry import CacheGeometry
from .wire import PULLED, decode_request, encode_request, in_order, notification


@dataclass(kw_only=True, eq=False)
class Shipment:
    """A WRITE posted by :meth:`PrefillSender.post`; :meth:`PrefillSender.check` drives it."""

    xfer: Xfer
    pins: list[Holding]  # the pinned sources, fixed until no byte of the WRITE can move
    result: ShipResult
    done: bool = False


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
            Hashable, tuple[list[Holding], float]
        ] = {}  # request -> (pinned sources, deadline)
        self.released: list[Hashable] = []  # offers whose pins are gone: pulled or expired

    def ship(
        self,
        peer: str,
        request: Hashable,
        src_blocks: Sequence[int],
        src_slots: Sequence[int],
        dst_blocks: Sequence[int],
        dst_slots: Sequence[int],
        dst_geometry: CacheGeometry,
        *,
        transfer: int,
        timeout_s: float = 30.0,
    ) -> ShipResult:
        """Write the request's blocks and slots into the peer's and wait for it:
        :meth:`post` then :meth:`check` until done (waits back off)."""
        shipment = self.post(
            peer,
            request,
            src_blocks,
            src_slots,
            dst_blocks,
            dst_slots,
            dst_geometry,
            transfer=transfer,
            timeout_s=timeout_s,
        )
        pause = 20e-6
        while not self.check(shipment):
            time.sleep(pause)
            pause = min(pause * 2, WAIT_BACKOFF_MAX_S)
        return shipment.result

    def post(
        self,
        peer: str,
        request: Hashable,
        src_blocks: Sequence[int],
        src_slots: Sequence[int],
        dst_blocks: Sequence[int],
        dst_slots: Sequence[int],
        dst_geometry: CacheGeometry,
        *,
        transfer: int,
        timeout_s: float = 30.0,
    ) -> Shipment:
        """Start writing the request's blocks and slots into the peer's, without
        waiting (many can be in flight); :meth:`check` drives it. Its notification
        names ``transfer`` (the id the receiver's :meth:`DecodeReceiver.expect`
        handed out), so a late write of an earlier attempt is never taken for this one.

        The source blocks are pinned until no byte of the transfer can move any
        more. On failure or timeout the transfer is cancelled and the receiver is
        told so (an abort notification, which frees its allocation at once), or,
        where NIXL cannot cancel it yet, both happen on the poll that settles it;
        :class:`TransferError` is raised either way.
        """
        timeout_s = check_timeout(timeout_s, "ship: timeout_s")
        transfer = check_int(transfer, "ship: transfer", lo=1)
        encode_request(request)  # an id that cannot cross is refused before anything is pinned
        self._settle()
        try:
            plan = plan_request(
                self.geometry(), dst_geometry, src_blocks, dst_blocks, src_slots, dst_slots
            )
            pins = self._pin(src_blocks, src_slots, "ship")
        except Error:
            # Refused before a byte moved (a layout mismatch, bad ids): the receiver
            # need not hold the allocation until its deadline.
            if peer in self._peers:
                self.abort(peer, request, transfer)
            raise

        def aborted() -> None:
            self._unpin(pins)
            self.abort(peer, request, transfer)

        x = self._begin(
            "WRITE",
            peer,
            request,
            (src_blocks, src_slots),
            (dst_blocks, dst_slots),
            notification("w", transfer, request),
            timeout_s,
            on_settled=aborted,
        )
        return Shipment(
            xfer=x,
            pins=pins,
            result=ShipResult(
                request=request, descriptors=plan.count, nbytes=plan.nbytes, seconds=0.0
            ),
        )

    def check(self, shipment: Shipment) -> bool:
        """True once the WRITE is done (its pins released, ``shipment.result``
        timed); False while it runs; :class:`TransferError` if it failed."""
        if shipment.done:
            return True
        if not self._step(shipment.xfer):
            return False
        self._unpin(shipment.pins)
        shipment.done = True
        shipment.result = dataclasses.replace(shipment.result, seconds=shipment.xfer.seconds)
        return True

    def _pin(self, blocks: Sequence[int], slots: Sequence[int], what: str) -> list[Holding]:
        """One more reference on each source block, and the sources as fixed holdings:
        a peer reads or writes them by address, so no boundary move may relocate
        them until :meth:`_unpin`. All or nothing: checked before anything is taken."""
        slot_ids = self.cache.slots.check_held(slots, f"{what}: source slots").tolist()
        pins = self.cache.blocks.pin(blocks, f"{what}: source blocks")
        owners = list(dict.fromkeys(self.cache.slots.owner(s) for s in slot_ids))
        return [self.cache.hold(None, pins, fixed=True)] + [
            self.cache.hold(owner, [], fixed=True) for owner in owners
        ]

    def _unpin(self, pins: list[Holding]) -> None:
        for b in pins[0].blocks:
            self.cache.blocks.release(b)
        for holding in pins:
            self.cache.let_go(holding)

    def abort(self, peer: str, request: Hashable, transfer: int) -> None:
        """Tell ``peer`` that ``transfer`` will not be written (a request the prefill
        gave up on, or a WRITE that failed and is cancelled): the receiver frees its
        allocation at once. Only for a transfer none of whose bytes can still land.
        Best effort: a peer that is gone has nothing left to free."""
        msg = notification("a", check_int(transfer, "abort: transfer", lo=1), request)
        try:
            self.agent.send_notif(peer, msg)
        except Exception:
            return
        self._push_out()  # delivered now, even on a connection that carried nothing yet

    def offer(
        self,
        request: Hashable,
        blocks: Sequence[int],
        slots: Sequence[int],
        *,
        timeout_s: float = 30.0,
    ) -> dict:
        """Pin a request's blocks for a peer to READ; returns the ids and this geometry."""
        timeout_s = check_timeout(timeout_s, "offer: timeout_s")
        encode_request(request)
        if request in self._offers:
            raise InvalidValueError(f"request {request!r} is already offered")
        slot_ids = self.cache.slots.check_held(slots, "offer: slots").tolist()
        pins = self._pin(blocks, slot_ids, "offer")
        self._offers[request] = (pins, time.monotonic() + timeout_s)
        return {
            "blocks": list(pins[0].blocks),
            "slots": slot_ids,
            "geometry": self.geometry().to_dict(),
        }

    def poll(self) -> list[Hashable]:
        """Release the pins of offers the peer has read, or that expired; return them."""
        done: list[Hashable] = []
        for msgs in self.progress().values():
            for msg in msgs:
                text = msg.decode(errors="replace")
                if text.startswith(PULLED):
                    request = decode_request(text[len(PULLED) :])
                    if request is not None and request in self._offers:
                        done.append(request)
        now = time.monotonic()
        done += [r for r, (_, deadline) in self._offers.items() if now > deadline and r not in done]
        for request in done:
            self._unpin(self._offers.pop(request)[0])
        self.released.extend(done)
        return done

    @property
    def offered(self) -> list[Hashable]:
        return in_order(self._offers)
