"""One side of a prefill -> decode transfer: a NIXL agent over a unified cache's buffer.

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
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import Error, InvalidValueError, LayoutMismatchError
from ..pools import UnifiedCache
from .geometry import CacheGeometry

WAIT_BACKOFF_MAX_S = 0.003
"""Waiting for a transfer polls at 20 us, doubling to this: a short transfer is
seen within microseconds, a long wait costs a few percent of a core at most."""
NOTIF_FLUSH_S = 0.02
"""How long a side drives its worker after sending a notification (an abort):
on loopback a connection's wire-up and the message take well under this."""
NOTIF_POLL_S = 0.0005
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


def nixl_api():
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


@dataclass(frozen=True, kw_only=True)
class ShipResult:
    """What one shipped or pulled request moved, and how long it took."""

    request: Hashable
    descriptors: int
    nbytes: int
    seconds: float


class NixlEndpoint:
    """One side of a transfer: a NIXL agent over a unified cache's buffer."""

    def __init__(self, name: str, cache: UnifiedCache) -> None:
        if cache.buf.device.type not in ("cpu", "cuda"):
            raise InvalidValueError(f"NIXL registers CPU or CUDA memory, not {cache.buf.device}")
        # A system libibverbs makes UCX's IB module crash NIXL processes at
        # exit; loopback and TCP never need it. UCX reads this when the agent
        # starts, so a caller's own setting wins.
        os.environ.setdefault("UCX_MODULES", "^ib")
        nixl_agent, nixl_agent_config = nixl_api()
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
        self._inbox: dict[str, list[bytes]] = {}  # notifications taken while pushing one out

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
        got = self._take_notifs()
        inbox, self._inbox = self._inbox, {}
        for peer, msgs in got.items():
            inbox.setdefault(peer, []).extend(msgs)
        return inbox

    def _take_notifs(self) -> dict[str, list[bytes]]:
        got = self.agent.get_new_notifs()
        return {(p.decode() if isinstance(p, bytes) else p): list(m) for p, m in got.items()}

    def _push_out(self, budget_s: float = NOTIF_FLUSH_S) -> None:
        """Drive the worker for ``budget_s`` after a notification was sent, keeping
        what arrives for :meth:`progress`: UCX sends on a connection not yet
        wired up (one that carried no transfer) only while its worker is
        driven, and a side that then goes idle would hold the message back."""
        deadline = time.monotonic() + budget_s
        while True:
            for peer, msgs in self._take_notifs().items():
                self._inbox.setdefault(peer, []).extend(msgs)
            if time.monotonic() >= deadline:
                return
            time.sleep(NOTIF_POLL_S)

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
