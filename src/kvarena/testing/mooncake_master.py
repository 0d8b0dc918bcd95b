"""A Mooncake Store master on loopback, for tests and benchmarks.

The ``mooncake_master`` binary the Mooncake wheel ships, on free loopback
ports (its RPC port and its metrics port), its log in a file; ``url`` is the
tier spec that reaches it. The binary needs ``libibverbs`` at load even for
TCP (Debian's ``libibverbs1``; ``make test`` installs it).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
from pathlib import Path

from ..errors import Error
from .vllm_server import free_port


class MooncakeMasterError(Error, RuntimeError):
    """The master did not start."""


def find_mooncake_master() -> str | None:
    """The wheel's ``mooncake_master``, or None where Mooncake is not installed."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "mooncake_master")
    return path if os.access(path, os.X_OK) else None


class MooncakeMaster:
    def __init__(self, log_path: str | Path, *, binary: str | None = None) -> None:
        found = binary or find_mooncake_master()
        if found is None:
            raise MooncakeMasterError("mooncake_master is not installed (kvarena[mooncake])")
        self.port = free_port()
        self.url = f"mooncake://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                found,
                f"--rpc_port={self.port}",
                "--rpc_address=127.0.0.1",
                f"--metrics_port={free_port()}",
                "--metrics_host=127.0.0.1",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait()
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-500:]
                raise MooncakeMasterError(
                    f"mooncake_master exited with {self.proc.returncode}: {tail}"
                )
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise MooncakeMasterError(f"mooncake_master not listening after {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
