"""Two local processes, a prefill and a decode side, driven over pipes.

What the demo, the benchmark and the tests share to move a request between
two engines on one machine: each side runs in its own spawned process (its
own NIXL agent and UCX worker, :mod:`.pair_side`), serves commands from the
parent over a ``multiprocessing`` pipe, and the parent relays the control
messages between them (hello, expected requests, ids). The data path is
NIXL's, never the pipes.

Sides are forked from ``multiprocessing``'s fork server with this module (and
torch with it) imported once: a side starts in a fraction of a second
instead of importing torch anew (~1.7 s of CPU each), and never forks the
caller itself, whose threads (torch's, a test runner's) a fork would copy
mid-step. NIXL is imported in the side, after its environment is set.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback
from typing import Any

from ..pools import CachePlan
from .pair_side import IDLE_POLL_S, HarnessError, _Side


def _answer(conn, side: _Side, op: str, args: tuple) -> None:
    try:
        conn.send(("ok", getattr(side, op)(*args)))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _serve(conn, role: str, plan: CachePlan, env: dict[str, str]) -> None:
    """Serve parent commands; a ``decode-service`` also serves its ZeroMQ channel."""
    os.environ.update(env)
    # NIXL logs every agent start at INFO (its logger's level is set when the
    # module loads); the parent reports what matters.
    from .endpoint import nixl_available

    if nixl_available():
        for name in ("nixl", "nixl.nixl_cu12", "nixl.nixl_cu12._api"):
            logging.getLogger(name).setLevel(logging.WARNING)
    side = service = None
    try:
        side = _Side(role, plan)
        if role == "decode-service":
            from .service import DecodeService

            service = DecodeService(side.receiver)
            conn.send(("ok", service.endpoint))
            stop = False

            def until() -> bool:
                nonlocal stop
                while not stop and conn.poll():
                    op, args = conn.recv()
                    if op == "quit":
                        stop = True
                    else:
                        _answer(conn, side, op, args)
                return stop

            service.serve(until)
            return
        conn.send(("ok", None))
        while True:
            # The decode side must keep its UCX worker moving while it waits.
            while not conn.poll(IDLE_POLL_S):
                if role == "decode":
                    side.receiver.poll()
                else:
                    side.sender.poll()  # releases the pins of pulled offers
            op, args = conn.recv()
            if op == "quit":
                break
            _answer(conn, side, op, args)
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if service is not None:
            service.close()
        if side is not None:
            if side.client is not None:
                side.client.close()
            side.ep.close()
        conn.close()


class SideProcess:
    """A process serving one side (forked from the fork server); ``call`` runs a command there."""

    def __init__(
        self,
        role: str,
        plan: CachePlan,
        env: dict[str, str] | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        ctx = mp.get_context("forkserver")
        # Takes effect where this process's fork server is not running yet; a
        # server started by others without it still serves, importing per side.
        ctx.set_forkserver_preload([__name__])
        self.conn, child = ctx.Pipe()
        self.timeout_s = timeout_s
        self.process = ctx.Process(
            target=_serve,
            # the caller's environment now, not the fork server's when it started
            args=(child, role, plan, {**os.environ, **(env or {})}),
            daemon=True,
            name=f"kvarena-{role}",
        )
        self.process.start()
        child.close()
        status, detail = self._recv()
        if status != "ok":
            self.stop()
            raise HarnessError(f"{role} side failed to start: {detail}")
        self.endpoint: str | None = detail  # a decode-service's control channel

    def _recv(self) -> tuple[str, Any]:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"{self.process.name} did not answer within {self.timeout_s}s")
        return self.conn.recv()

    def call(self, op: str, *args: Any) -> Any:
        self.post(op, *args)
        return self.result(op)

    def post(self, op: str, *args: Any) -> None:
        """Start a command without waiting for it (so a test can kill or stop the
        process while it runs); :meth:`result` collects its answer."""
        self.conn.send((op, args))

    def result(self, op: str = "command") -> Any:
        status, value = self._recv()
        if status != "ok":
            raise HarnessError(f"{self.process.name}.{op}: {value}")
        return value

    def cpu_seconds(self) -> float:
        """User + system CPU time the process has used so far (Linux /proc)."""
        with open(f"/proc/{self.process.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> int | None:
        """Ask the side to quit; kill it if it does not; return its exit code."""
        if self.process.is_alive():
            try:
                self.conn.send(("quit", ()))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(20)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.conn.close()
        return self.process.exitcode


def connect_pair(prefill: SideProcess, decode: SideProcess) -> tuple[str, str]:
    """Exchange hellos both ways; returns (decode's name at prefill, prefill's name at decode)."""
    hp, hd = prefill.call("hello"), decode.call("hello")
    return prefill.call("connect", hd), decode.call("connect", hp)


def ship_request(
    prefill: SideProcess,
    decode: SideProcess,
    peer: str,
    request: str,
    num_blocks: int,
    seed: int,
    *,
    timeout_s: float = 30.0,
) -> dict:
    """Fill a request on the prefill side, ship it, wait for it; compare digests."""
    src = prefill.call("fill", request, num_blocks, seed)
    dst = decode.call("expect", request, num_blocks, timeout_s)
    shipped = prefill.call("ship", peer, request, dst, timeout_s)
    got = decode.call("wait", request, timeout_s)
    return {**shipped, "byte_exact": got["digests"] == src["digests"], "src": src, "dst": dst}
