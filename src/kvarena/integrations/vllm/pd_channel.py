"""The prefill engine's side channel: its workers' NIXL hellos, and leases on its offers.

A decode engine's scheduler asks the prefill engine two things before its
workers READ (:class:`Asker`): the hellos of the prefill workers (NIXL
agent metadata, span table, namespace: :class:`Hello`, one per
tensor-parallel rank), once per engine; and a lease on the request's blocks
(:class:`OfferBook`), once per request. The lease is what makes a late READ
impossible: the prefill engine keeps a request's blocks at least until its
lease ends, and the decode worker gives up (cancels) its READ before that,
so no byte is read from blocks already given to another request, whatever
the two clocks say.

The channel is one ZeroMQ ROUTER socket on a thread of the prefill
engine's scheduler process, msgpack both ways; the address it listens on is
the ``remote_host``/``remote_port`` a prefill answer carries.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from ...errors import Error

POLL_MS = 100  # how often the listener looks up from its socket to see if it must stop


class ChannelError(Error, RuntimeError):
    """A prefill engine cannot be read from: its channel cannot listen or
    refused, or its cache means other bytes than this engine's."""


@dataclass(frozen=True, kw_only=True)
class Hello:
    """What one prefill worker tells a decode worker of the same rank."""

    rank: int
    agent: bytes  # NIXL agent metadata
    table: dict[str, Any]  # its :class:`~.pd_table.SpanTable`, as data
    namespace: bytes  # its rank's namespace: what its bytes mean

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "agent": self.agent,
            "table": self.table,
            "namespace": self.namespace,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Hello:
        return cls(
            rank=int(data["rank"]),
            agent=bytes(data["agent"]),
            table=dict(data["table"]),
            namespace=bytes(data["namespace"]),
        )


class OfferBook:
    """The prefill engine's held requests: each held until its expiry and any
    lease on it have passed (a monotonic clock of this process). Shared by the
    scheduler's thread and the channel's (a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}

    def hold(self, request: str, seconds: float) -> None:
        with self._lock:
            self._until[request] = time.monotonic() + seconds

    def lease(self, request: str, seconds: float) -> bool:
        """Extend a held request's hold to ``seconds`` from now at least; False
        where it is no longer held (read, expired, or never offered)."""
        with self._lock:
            until = self._until.get(request)
            if until is None:
                return False
            self._until[request] = max(until, time.monotonic() + seconds)
            return True

    def expired(self) -> list[str]:
        """The requests whose hold has passed, no longer held."""
        now = time.monotonic()
        with self._lock:
            gone = [r for r, t in self._until.items() if t <= now]
            for r in gone:
                del self._until[r]
        return gone

    def drop(self, request: str) -> None:
        """A reader's word that it will not read ``request``: its hold ends now."""
        with self._lock:
            if request in self._until:
                self._until[request] = 0.0

    def release(self, requests: set[str]) -> None:
        with self._lock:
            for r in requests:
                self._until.pop(r, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._until)


class Channel:
    """The listener: answers ``hello`` (a rank's :class:`Hello`), ``lease`` and
    ``release`` (a reader that will not read)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        engine_id: str,
        hellos: Mapping[int, Hello],
        offers: OfferBook,
    ) -> None:
        self._engine_id = engine_id
        self._hellos = dict(hellos)
        self._offers = offers
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise ChannelError(f"cannot listen on {host}:{port}: {exc}") from None
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvarena-pd-channel", daemon=True)
        self._thread.start()

    def _answer(self, ask: Mapping[str, Any]) -> dict[str, Any]:
        op = ask.get("op")
        if ask.get("engine_id") != self._engine_id:
            return {"ok": False, "why": f"this is engine {self._engine_id}"}
        if op == "hello":
            hello = self._hellos.get(ask.get("rank"))  # type: ignore[arg-type]
            if hello is None:
                return {
                    "ok": False,
                    "why": f"no rank {ask.get('rank')!r}: ranks {sorted(self._hellos)}",
                }
            return {"ok": True, "hello": hello.to_dict(), "tp_size": len(self._hellos)}
        if op == "lease":
            held = self._offers.lease(str(ask.get("request")), float(ask.get("seconds", 0)))
            return {"ok": held, "why": "" if held else "not held (read, expired or unknown)"}
        if op == "release":
            self._offers.drop(str(ask.get("request")))
            return {"ok": True}
        return {"ok": False, "why": f"unknown op {op!r}"}

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(POLL_MS):
                continue
            ident, _, body = self._sock.recv_multipart()
            try:
                asked = msgspec.msgpack.decode(body)
                answer = self._answer(asked)
                if "id" in asked:
                    answer["id"] = asked["id"]  # a pipelined asker matches answers by it
            except Exception as exc:  # a malformed ask costs its asker an answer, not the engine
                answer = {"ok": False, "why": f"malformed ask: {type(exc).__name__}"}
            self._sock.send_multipart([ident, b"", msgspec.msgpack.encode(answer)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()
        self._ctx.term()


class Asker:
    """Asks that never block: each is sent at once and its answer taken by a later
    :meth:`answers`, so a decode engine's scheduler asks from its own steps.
    (Not from a worker: under ``vllm serve`` on a CPU a worker's other threads
    starve while it serves steps — measured, a thread of a decode worker ran
    110 times in a minute, and its ZeroMQ socket never sent.) One DEALER socket
    per channel, answers matched by the ask's ``id``."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._socks: dict[tuple[str, int], zmq.Socket] = {}
        self._next = 0

    def send(self, host: str, port: int, message: Mapping[str, Any]) -> int:
        sock = self._socks.get((host, port))
        if sock is None:
            sock = self._socks[(host, port)] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{host}:{port}")
        self._next += 1
        body = msgspec.msgpack.encode({**message, "id": self._next})
        try:
            sock.send_multipart([b"", body], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # never answered: its asker gives up at its deadline
        return self._next

    def answers(self) -> dict[int, dict[str, Any]]:
        """Every answer that arrived since the last call, by ask id."""
        out: dict[int, dict[str, Any]] = {}
        for sock in self._socks.values():
            while True:
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    answer = msgspec.msgpack.decode(frames[-1])
                    out[int(answer["id"])] = answer
                except Exception:  # not an answer to us: ignored
                    continue
        return out

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._ctx.term()
