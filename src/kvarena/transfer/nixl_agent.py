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

import dataclasses
import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..checks import check_int, check_timeout
from ..errors import Error, InvalidValueError, LayoutMismatchError
from ..pools import UnifiedCache
from .descriptors import plan_request
from .geometry import CacheGeometry
from .wire import decode_request, encode_request

WAIT_BACKOFF_MAX_S = 0.003
"""Waiting for a transfer polls at 20 us, doubling to this: a short transfer is
seen within microseconds, a long wait costs a few percent of a core at most."""
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
class _InFlight:
    """A transfer NIXL could not cancel: it may still move bytes until it ends."""

    handle: object
    on_settled: Callable[[], None]


def _notif(kind: str, transfer: int, request: Hashable) -> bytes:
    """A transfer's notification: ``w`` (its WRITE landed) or ``a`` (its sender
    aborted it, and no byte of it can land any more), with the transfer id and
    the request id in its wire form (:mod:`.wire`: it decodes to an equal id)."""
    return f"{kind}:{transfer}:{encode_request(request)}".encode()


def _parse_notif(msg: bytes) -> tuple[str, int, Hashable] | None:
    kind, _, rest = msg.decode(errors="replace").partition(":")
    tid, _, text = rest.partition(":")
    request = decode_request(text)
    if kind in ("w", "a") and tid.isascii() and tid.isdigit() and request is not None:
        return kind, int(tid), request
    return None


def _in_order(ids: Iterable[Hashable]) -> list[Hashable]:
    """Request ids sorted (by their repr where their types do not compare)."""
    ids = list(ids)
    try:
        return sorted(ids)  # type: ignore[type-var]
    except TypeError:
        return sorted(ids, key=repr)


PULLED = "pulled:"
"""The prefix of a pull's completion notification (then the request's wire form)."""


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


@dataclass(kw_only=True, eq=False)
class Xfer:
    """One posted transfer: what it moves for whom, its NIXL handle and state."""

    op: str
    peer: str
    request: Hashable
    start: float
    timeout_s: float
    on_settled: Callable[[], None] | None
    handle: object = None
    state: str = "PROC"
    seconds: float = 0.0


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
        self._in_flight: list[_InFlight] = []

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
        self._settle()
        return self.agent.get_new_notifs()

    def _settle(self) -> None:
        """Retry releasing the handles NIXL could not cancel; once one is released
        (its transfer ended: no byte of it can move any more), run its ``on_settled``."""
        still = []
        for f in self._in_flight:
            try:
                if self.agent.check_xfer_state(f.handle) == "PROC":
                    still.append(f)
                    continue
                self.agent.release_xfer_handle(f.handle)
            except Exception:
                still.append(f)
                continue
            f.on_settled()
        self._in_flight = still

    @property
    def in_flight(self) -> int:
        """Abandoned transfers NIXL could not cancel yet (they settle on a later poll)."""
        return len(self._in_flight)

    def _begin(
        self,
        op: str,
        peer: str,
        request: Hashable,
        local: tuple[Sequence[int], Sequence[int]],
        remote: tuple[Sequence[int], Sequence[int]],
        notif: bytes,
        timeout_s: float,
        on_settled: Callable[[], None] | None = None,
    ) -> Xfer:
        """Post one prepped transfer of (blocks, slots) index lists; :meth:`_step`
        drives it. A transfer that fails to post is given up at once."""
        p = self._peers.get(peer)
        if p is None:
            if on_settled is not None:
                on_settled()
            raise TransferError(f"no connected peer {peer!r}; connected: {sorted(self._peers)}")

        def indices(g: CacheGeometry, ids: tuple[Sequence[int], Sequence[int]]) -> np.ndarray:
            blocks, slots = (np.asarray(list(x), np.int64) for x in ids)
            return np.concatenate([blocks, g.max_blocks + slots]).astype(np.int32)

        x = Xfer(
            op=op,
            peer=peer,
            request=request,
            start=time.perf_counter(),
            timeout_s=timeout_s,
            on_settled=on_settled,
        )
        try:
            x.handle = self.agent.make_prepped_xfer(
                op,
                p.local_prep,
                indices(self.geometry(), local),
                p.remote_prep,
                indices(p.geometry, remote),
                notif_msg=notif,
            )
            x.state = self.agent.transfer(x.handle)
        except Exception as exc:  # NIXL's own errors, e.g. a peer that disconnected
            self._give_up(x)
            raise TransferError(
                f"request {request!r}: {op} with {peer!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        return x

    def _step(self, x: Xfer) -> bool:
        """True once ``x`` is done (its handle released); False while it runs.
        Raises :class:`TransferError` / :class:`TransferTimeout` after giving it up."""
        try:
            if x.state == "PROC":
                x.state = self.agent.check_xfer_state(x.handle)
        except Exception as exc:
            self._give_up(x)
            raise TransferError(
                f"request {x.request!r}: {x.op} with {x.peer!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if x.state == "PROC":
            if time.perf_counter() > x.start + x.timeout_s:
                self._give_up(x)
                raise TransferTimeout(
                    f"request {x.request!r}: {x.op} with {x.peer!r} not done after {x.timeout_s}s"
                )
            return False
        if x.state != "DONE":
            self._give_up(x)
            raise TransferError(
                f"request {x.request!r}: {x.op} with {x.peer!r} ended in state {x.state!r}"
            )
        x.seconds = time.perf_counter() - x.start
        try:
            self.agent.release_xfer_handle(x.handle)
        except Exception:  # done, but NIXL kept the handle: retried on a later poll
            self._in_flight.append(_InFlight(handle=x.handle, on_settled=lambda: None))
        return True

    def _give_up(self, x: Xfer) -> None:
        """Release (which cancels) a failed transfer; ``on_settled`` runs once no byte
        of it can move any more: at once when NIXL cancelled it, else on the poll that
        finally releases it (until then it is counted in :attr:`in_flight`)."""
        settled = () if x.on_settled is None else (x.on_settled,)
        if x.handle is not None:
            try:
                self.agent.release_xfer_handle(x.handle)
            except Exception:  # still moving bytes: NIXL could not cancel it
                self._in_flight.append(
                    _InFlight(handle=x.handle, on_settled=x.on_settled or (lambda: None))
                )
                return
        for fn in settled:
            fn()

    def _post(
        self,
        op: str,
        peer: str,
        request: Hashable,
        local: tuple[Sequence[int], Sequence[int]],
        remote: tuple[Sequence[int], Sequence[int]],
        notif: bytes,
        timeout_s: float,
        on_settled: Callable[[], None] | None = None,
    ) -> float:
        """One transfer to its end; seconds it took. Waiting backs off (20 us
        doubling to ``WAIT_BACKOFF_MAX_S``): a waiting side costs next to no CPU,
        and a short transfer still completes within microseconds."""
        x = self._begin(op, peer, request, local, remote, notif, timeout_s, on_settled)
        pause = 20e-6
        while not self._step(x):
            time.sleep(pause)
            pause = min(pause * 2, WAIT_BACKOFF_MAX_S)
        return x.seconds

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
    request: Hashable
    descriptors: int
    nbytes: int
    seconds: float


@dataclass(kw_only=True, eq=False)
class Shipment:
    """A WRITE posted by :meth:`PrefillSender.post`; :meth:`PrefillSender.check` drives it."""

    xfer: Xfer
    pins: list[int]
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
            Hashable, tuple[list[int], float]
        ] = {}  # request -> (pinned blocks, deadline)
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
            self.cache.slots.check_held(src_slots, "ship: source slots")
            pins = self.cache.blocks.pin(src_blocks, "ship: source blocks")
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
            _notif("w", transfer, request),
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

    def _unpin(self, pins: list[int]) -> None:
        for b in pins:
            self.cache.blocks.release(b)

    def abort(self, peer: str, request: Hashable, transfer: int) -> None:
        """Tell ``peer`` that ``transfer`` will not be written (a request the prefill
        gave up on, or a WRITE that failed and is cancelled): the receiver frees its
        allocation at once. Only for a transfer none of whose bytes can still land.
        Best effort: a peer that is gone has nothing left to free."""
        msg = _notif("a", check_int(transfer, "abort: transfer", lo=1), request)
        try:
            self.agent.send_notif(peer, msg)
        except Exception:
            pass

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
        pins = self.cache.blocks.pin(blocks, "offer: blocks")
        self._offers[request] = (pins, time.monotonic() + timeout_s)
        return {"blocks": pins, "slots": slot_ids, "geometry": self.geometry().to_dict()}

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
            for b in self._offers.pop(request)[0]:
                self.cache.blocks.release(b)
        self.released.extend(done)
        return done

    @property
    def offered(self) -> list[Hashable]:
        return _in_order(self._offers)


@dataclass
class _Pending:
    blocks: list[int]
    slots: tuple[int, ...]
    deadline: float
    transfer: int = 0  # this attempt's id: its notifications must carry it
    peer: str | None = None  # who will write it, where known
    owner: Hashable = None  # the slot allocator's owner key: (request, transfer)


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
            slots = self.cache.allocate_state(owner) if with_state else ()
        except Exception:
            for b in blocks:
                self.cache.blocks.release(b)
            raise
        self._next_transfer += 1
        self._pending[request] = _Pending(
            blocks, tuple(slots), time.monotonic() + timeout_s, transfer, peer, owner
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
        self.ready[request] = p
        return ShipResult(
            request=request, descriptors=plan.count, nbytes=plan.nbytes, seconds=seconds
        )

    def _free(self, p: _Pending) -> None:
        for b in p.blocks:
            self.cache.blocks.release(b)
        if p.slots:
            self.cache.free_state(p.owner)

    def _release(self, transfer: int) -> Hashable | None:
        """Free a quarantined allocation: no write of its transfer can land now."""
        held = self._quarantine.pop(transfer, None)
        if held is None:
            return None
        self._free(held[1])
        return held[0]

    def _release_quietly(self, transfer: int) -> None:
        self._release(transfer)

    def poll(self) -> ReceiverEvents:
        """Progress NIXL; mark notified requests ready, free what aborts and late
        completions release, quarantine the requests past their deadline."""
        events = ReceiverEvents()
        for msgs in self.progress().values():
            for msg in msgs:
                parsed = _parse_notif(msg)
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
        ``cache.free_state(owner)``); the receiver forgets them."""
        try:
            p = self.ready.pop(request)
        except KeyError:
            raise InvalidValueError(f"request {request!r} is not ready") from None
        return p.blocks, p.slots, p.owner

    def held_pending(self) -> list[_Pending]:
        """Allocations a peer may still write: awaited requests and quarantined ones."""
        return list(self._pending.values()) + [p for _, p in self._quarantine.values()]

    @property
    def pending(self) -> list[Hashable]:
        return _in_order(self._pending)

    @property
    def quarantined(self) -> list[Hashable]:
        """Requests whose allocation waits for proof that no write can land."""
        return _in_order(r for r, _ in self._quarantine.values())
