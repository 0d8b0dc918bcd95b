"""The control channel between hosts: a decode service and a prefill client on ZeroMQ.

The data path is NIXL's; this channel carries only small JSON messages: the
hello (NIXL metadata and :class:`CacheGeometry`), "expect this request"
(answered with destination ids) and status queries. The decode side runs one
loop that alternates between the channel and NIXL progress, so a single
thread drives both (NIXL agents are not shared across threads here).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Sequence

import zmq

from ..checks import check_timeout
from ..errors import InvalidValueError
from .geometry import CacheGeometry
from .nixl_agent import DecodeReceiver, PrefillSender, ShipResult, TransferError, TransferTimeout


def receiver_deadline(write_timeout_s: float) -> float:
    """How long the decode side holds an expected request for a WRITE allowed
    ``write_timeout_s``: 1.5x plus a second, a margin for the control call that
    precedes the WRITE and for clocks that start at different moments."""
    return 1.5 * write_timeout_s + 1.0


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

    def _handle(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "hello":
            name = self.receiver.connect(_decode_hello(msg["hello"]))
            return {"hello": _encode_hello(self.receiver.hello()), "peer": name}
        if op == "expect":
            return self.receiver.expect(
                msg["request"],
                int(msg["blocks"]),
                timeout_s=float(msg["timeout_s"]),
                peer=msg.get("peer"),
            )
        if op == "status":
            request = msg["request"]
            if request in self.receiver.ready:
                return {"status": "ready"}
            if request in self.receiver.pending:
                return {"status": "pending"}
            reasons = [r for q, r in self.receiver.failed if q == request]
            return {"status": "failed", "reason": reasons[-1]} if reasons else {"status": "unknown"}
        raise InvalidValueError(f"unknown control message {op!r}; known: hello, expect, status")

    def serve(self, until: Callable[[], bool], poll_ms: int = 1) -> None:
        """Answer clients and progress NIXL until ``until()`` is true."""
        while not until():
            if self._sock.poll(poll_ms):
                ident, _, raw = self._sock.recv_multipart()
                try:
                    reply = self._handle(json.loads(raw))
                except Exception as exc:
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                self._sock.send_multipart([ident, b"", json.dumps(reply).encode()])
            self.receiver.poll()

    def close(self) -> None:
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
        self.peer: str | None = None

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
        reply = json.loads(raw)
        if "error" in reply:
            raise TransferError(f"decode service refused {msg['op']!r}: {reply['error']}")
        return reply

    def connect(self) -> str:
        """Exchange hellos (each side checks the other's layout) and connect NIXL both ways."""
        reply = self._call({"op": "hello", "hello": _encode_hello(self.sender.hello())})
        self.peer = self.sender.connect(_decode_hello(reply["hello"]))
        return self.peer

    def ship(self, request: str, blocks: Sequence[int], slots: Sequence[int]) -> ShipResult:
        """Ask the decode side to expect ``request``, then write it there."""
        if self.peer is None:
            raise TransferError("connect() first")
        dst = self._call(
            {
                "op": "expect",
                "request": request,
                "blocks": len(blocks),
                # The receiver waits past the WRITE's own deadline, so a write that
                # finishes in time is never declared late; a sender that gives up
                # sends an abort, which frees the receiver's allocation at once.
                "timeout_s": receiver_deadline(self.timeout_s),
                "peer": self.sender.agent_name,
            }
        )
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
        return self._call({"op": "status", "request": request})

    def wait_ready(self, request: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while (status := self.status(request))["status"] != "ready":
            if status["status"] in ("failed", "unknown") or time.monotonic() > deadline:
                raise TransferError(f"request {request!r} is {status}")
            time.sleep(0.001)

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
