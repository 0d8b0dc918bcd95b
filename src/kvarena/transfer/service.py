"""The control channel between hosts: a decode service and a prefill client on ZeroMQ.

The data path is NIXL's; this channel carries only small JSON messages: the
hello (NIXL metadata and :class:`CacheGeometry`), "expect this request"
(answered with destination ids) and status queries. The decode side runs one
loop that alternates between the channel and NIXL progress, so a single
thread drives both (NIXL agents are not shared across threads here).

Liveness: each client also holds one plain TCP connection to the service for
its whole life (the *link*), naming its NIXL agent. The kernel closes a killed
process's sockets, so the service sees the link end at once and drops that
peer (:meth:`DecodeReceiver.drop_peer`: its pending and quarantined
allocations are freed — a dead process writes nothing more). A stopped
process keeps its link open, so nothing of its is freed while it might still
write. A dead host is found by TCP keepalive within ``KEEPALIVE_S`` seconds.
(ZeroMQ's sockets reconnect by themselves and hide this, hence a plain one.)
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import select
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import zmq

from ..checks import check_timeout
from ..errors import InvalidValueError
from .endpoint import ShipResult, TransferError, TransferTimeout
from .geometry import CacheGeometry
from .receiver import DecodeReceiver
from .sender import PrefillSender
from .wire import decode_request, encode_request


def receiver_deadline(write_timeout_s: float) -> float:
    """How long the decode side holds an expected request for a WRITE allowed
    ``write_timeout_s``: 1.5x plus a second, a margin for the control call that
    precedes the WRITE and for clocks that start at different moments."""
    return 1.5 * write_timeout_s + 1.0


KEEPALIVE_S = (2, 1, 3)
"""TCP keepalive on the liveness link: idle seconds, interval, probes — a
silent dead host is noticed after about 5 s."""


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in zip(
        ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE_S, strict=True
    ):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


ATTEMPTS_KEPT = 4096
"""Expect attempts a service remembers (answered, or cancelled before read)."""


def _attempt(msg: dict, *, required: bool) -> str | None:
    """A message's expect-attempt token (optional on ``expect``: older clients)."""
    if (attempt := msg.get("attempt")) is None and not required:
        return None
    if not isinstance(attempt, str) or not attempt:
        raise InvalidValueError(
            f"control message {msg.get('op')!r}: attempt must be the non-empty string token "
            f"its expect carried, got {attempt!r:.80}"
        )
    return attempt


def _remember(book: OrderedDict, key: str, value: object) -> None:
    book[key] = value
    while len(book) > ATTEMPTS_KEPT:
        book.popitem(last=False)


def _endpoint_host(endpoint: str) -> str:
    """``tcp://HOST:PORT`` -> HOST (brackets of an IPv6 address removed)."""
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    return host.strip("[]")


@dataclass
class _Link:
    peer: str | None = None
    buf: bytes = b""


@dataclass
class LinkEvents:
    """Peers whose link ended (their process is gone) and the requests freed."""

    dropped: list[tuple[str, list[Hashable]]] = field(default_factory=list)


def _encode_hello(hello: dict) -> dict:
    return {**hello, "metadata": base64.b64encode(hello["metadata"]).decode()}


def _decode_hello(msg: dict) -> dict:
    return {**msg, "metadata": base64.b64decode(msg["metadata"])}


class DecodeService:
    """Serves prefill clients: hello, expect, status. Bind with ``tcp://HOST:*`` for any port."""

    def __init__(self, receiver: DecodeReceiver, endpoint: str = "tcp://127.0.0.1:*") -> None:
        self.receiver = receiver
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        host = _endpoint_host(self.endpoint)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listen = socket.create_server((host, 0), family=family)
        self._listen.setblocking(False)
        self.liveness_port: int = self._listen.getsockname()[1]
        self._links: dict[socket.socket, _Link] = {}
        self.dropped: deque[tuple[str, list[Hashable]]] = deque(maxlen=1024)
        # each expect's attempt token -> its transfer, and the attempts cancelled
        # before their expect was read (the two come on different sockets)
        self._attempts: OrderedDict[str, int] = OrderedDict()
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    def _handle(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "hello":
            name = self.receiver.connect(_decode_hello(msg["hello"]))
            return {
                "hello": _encode_hello(self.receiver.hello()),
                "peer": name,
                "liveness_port": self.liveness_port,
            }
        if op in ("expect", "status"):
            request = decode_request(msg.get("request"))
            if request is None:
                raise InvalidValueError(f"control message {op!r} carries no request id it can read")
        if op == "expect":
            attempt = _attempt(msg, required=False)
            if attempt is not None and attempt in self._cancelled:
                raise InvalidValueError(
                    f"expect of {request!r}: its sender cancelled this attempt; nothing allocated"
                )
            reply = self.receiver.expect(
                request,
                int(msg["blocks"]),
                timeout_s=float(msg["timeout_s"]),
                peer=msg.get("peer"),
            )
            if attempt is not None:
                _remember(self._attempts, attempt, int(reply["transfer"]))
            return reply
        if op == "cancel":
            attempt = str(_attempt(msg, required=True))
            transfer = self._attempts.pop(attempt, None)
            if transfer is None:  # its expect not read yet: refused when it is
                _remember(self._cancelled, attempt, None)
                return {"cancelled": None}
            freed = self.receiver.cancel(transfer)
            return {"cancelled": encode_request(freed) if freed is not None else None}
        if op == "status":
            if request in self.receiver.ready:
                return {"status": "ready"}
            if request in self.receiver.pending:
                return {"status": "pending"}
            reasons = [r for q, r in self.receiver.failed if q == request]
            return {"status": "failed", "reason": reasons[-1]} if reasons else {"status": "unknown"}
        raise InvalidValueError(
            f"unknown control message {op!r}; known: hello, expect, cancel, status"
        )

    def check_links(self) -> LinkEvents:
        """Accept new links, read their peer names, and drop the peer of every
        link that ended (EOF, reset, or keepalive failure)."""
        events = LinkEvents()
        readable, _, _ = select.select([self._listen, *self._links], [], [], 0)
        for sock in readable:
            if sock is self._listen:
                try:
                    conn, _ = self._listen.accept()
                except OSError:
                    continue
                conn.setblocking(False)
                _keepalive(conn)
                self._links[conn] = _Link()
                continue
            link = self._links[sock]
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                if link.peer is None:
                    link.buf += data
                    if b"\n" in link.buf:
                        link.peer = link.buf.split(b"\n", 1)[0].decode(errors="replace")
                continue
            del self._links[sock]
            sock.close()
            if link.peer is not None:
                freed = self.receiver.drop_peer(link.peer)
                events.dropped.append((link.peer, freed))
                self.dropped.append((link.peer, freed))
        return events

    def serve(self, until: Callable[[], bool], poll_ms: int = 1) -> None:
        """Answer clients, watch their links and progress NIXL until ``until()`` is true."""
        while not until():
            self.check_links()
            if self._sock.poll(poll_ms):
                ident, _, raw = self._sock.recv_multipart()
                try:
                    reply = self._handle(json.loads(raw))
                except Exception as exc:
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                self._sock.send_multipart([ident, b"", json.dumps(reply).encode()])
            self.receiver.poll()

    def close(self) -> None:
        for sock in self._links:
            sock.close()
        self._listen.close()
        self._sock.close()
        self._ctx.term()


class PrefillClient:
    """Talks to one :class:`DecodeService`; ships requests with a :class:`PrefillSender`."""

    def __init__(self, sender: PrefillSender, endpoint: str, *, timeout_s: float = 30.0) -> None:
        self.sender = sender
        self.timeout_s = check_timeout(timeout_s, "PrefillClient: timeout_s")
        self.endpoint = endpoint
        self._ctx = zmq.Context()
        self._sock = self._open()
        # cancels of unanswered expects: delivered whenever the service runs again
        self._cancels = self._ctx.socket(zmq.DEALER)
        self._cancels.setsockopt(zmq.LINGER, 0)
        self._cancels.connect(endpoint)
        self.peer: str | None = None
        self._link: socket.socket | None = None

    def _open(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def _reset(self) -> None:
        """A request/reply socket that sent and got no answer is stuck mid-exchange
        (every later send fails): replace it, so the client keeps serving."""
        self._sock.close()
        self._sock = self._open()

    def _call(self, msg: dict) -> dict:
        try:
            self._sock.send(json.dumps(msg).encode())
            answered = self._sock.poll(int(self.timeout_s * 1000))
            raw = self._sock.recv() if answered else None
        except zmq.ZMQError as exc:
            self._reset()
            raise TransferError(
                f"control channel to {self.endpoint} failed on {msg['op']!r}: {exc}; "
                "the socket was reset, retry the call"
            ) from None
        if raw is None:
            self._reset()
            raise TransferTimeout(
                f"decode service at {self.endpoint} did not answer {msg['op']!r} within "
                f"{self.timeout_s}s; the socket was reset, the next call starts afresh"
            )
        try:
            reply = json.loads(raw)
        except (ValueError, RecursionError):
            reply = None
        if not isinstance(reply, dict):
            raise TransferError(
                f"decode service at {self.endpoint} answered {msg['op']!r} with what is not a "
                f"control reply: {bytes(raw)[:80]!r}"
            )
        if "error" in reply:
            raise TransferError(f"decode service refused {msg['op']!r}: {reply['error']}")
        return reply

    def connect(self) -> str:
        """Exchange hellos (each side checks the other's layout) and connect NIXL both ways."""
        reply = self._call({"op": "hello", "hello": _encode_hello(self.sender.hello())})
        self.peer = self.sender.connect(_decode_hello(reply["hello"]))
        if self._link is None and reply.get("liveness_port"):
            try:
                link = socket.create_connection(
                    (_endpoint_host(self.endpoint), int(reply["liveness_port"])),
                    timeout=self.timeout_s,
                )
                _keepalive(link)
                link.sendall(self.sender.agent_name.encode() + b"\n")
            except OSError as exc:
                raise TransferError(
                    f"liveness link to {self.endpoint} failed: {exc}; retry connect()"
                ) from None
            self._link = link
        return self.peer

    def expect(self, request: str, num_blocks: int) -> dict:
        """Ask the decode side to allocate for ``request``; its answer (ids, geometry,
        transfer id). The decode side holds it for :func:`receiver_deadline` of this
        client's timeout, or until this sender aborts it or its process is gone.
        Unanswered within the timeout, the attempt is cancelled (the service frees
        what it allocated for it, whenever it reads the expect): this sender never
        learned where to write, so nothing else would ever free it."""
        if self.peer is None:
            raise TransferError("connect() first")
        attempt = secrets.token_hex(16)
        try:
            return self._call(
                {
                    "op": "expect",
                    "request": encode_request(request),
                    "blocks": num_blocks,
                    # The receiver waits past the WRITE's own deadline, so a write that
                    # finishes in time is never declared late; a sender that gives up
                    # sends an abort, which frees the receiver's allocation at once.
                    "timeout_s": receiver_deadline(self.timeout_s),
                    "peer": self.sender.agent_name,
                    "attempt": attempt,
                }
            )
        except TransferTimeout:
            self._cancel(attempt)
            raise

    def _cancel(self, attempt: str) -> None:
        """Queue a cancel of an expect ``attempt`` on a socket of its own that is
        never reset: the service reads it whenever it runs again (a stalled one
        included), with no answer awaited (the answers are drained here)."""
        while self._cancels.poll(0):
            self._cancels.recv_multipart()
        with contextlib.suppress(zmq.ZMQError):
            self._cancels.send_multipart(
                [b"", json.dumps({"op": "cancel", "attempt": attempt}).encode()], zmq.NOBLOCK
            )

    def ship(self, request: str, blocks: Sequence[int], slots: Sequence[int]) -> ShipResult:
        """Ask the decode side to expect ``request``, then write it there."""
        dst = self.expect(request, len(blocks))
        assert self.peer is not None
        return self.sender.ship(
            self.peer,
            request,
            blocks,
            slots[: len(dst["slots"])],
            dst["blocks"],
            dst["slots"],
            CacheGeometry.from_dict(dst["geometry"]),
            transfer=int(dst["transfer"]),
            timeout_s=self.timeout_s,
        )

    def status(self, request: str) -> dict:
        return self._call({"op": "status", "request": encode_request(request)})

    def wait_ready(self, request: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while (status := self.status(request))["status"] != "ready":
            if status["status"] in ("failed", "unknown") or time.monotonic() > deadline:
                raise TransferError(f"request {request!r} is {status}")
            time.sleep(0.001)

    def close(self) -> None:
        """Close the client. Its link ends, and the service then frees everything
        this sender could write — so first every WRITE must have settled: a
        transfer NIXL has not released yet is waited for (up to ``timeout_s``),
        and if one remains, :class:`TransferError` leaves the client open."""
        deadline = time.monotonic() + self.timeout_s
        while self.sender is not None and self.sender.in_flight:
            if time.monotonic() > deadline:
                raise TransferError(
                    f"{self.sender.in_flight} WRITE(s) have not settled; the client stays open "
                    "(its peer would otherwise free blocks a write may still reach)"
                )
            self.sender.poll()
            time.sleep(0.001)
        if self._link is not None:
            self._link.close()
            self._link = None
        self._sock.close()
        self._cancels.close()
        self._ctx.term()
