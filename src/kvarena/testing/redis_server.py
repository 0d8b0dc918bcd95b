"""A real ``redis-server`` on a free localhost port, for tests and benchmarks.

The shared tier is tested against the server users run, not a mock: Debian's
package (``make test`` installs it when missing). The server keeps nothing on
disk, binds to 127.0.0.1 only, and evicts with ``allkeys-lru`` under
``maxmemory`` — the configuration the README asks of a shared store. ``stop``
and ``start`` keep the port, so a test can take the store away mid-run and
bring it back.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from ..errors import Error


class RedisServerError(Error, RuntimeError):
    """redis-server is missing or did not come up."""


def find_redis_server() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    def __init__(
        self, workdir: str, *, maxmemory: str = "256mb", binary: str | None = None
    ) -> None:
        found = binary or find_redis_server()
        if found is None:
            raise RedisServerError(
                "redis-server is not installed (Debian: apt install redis-server)"
            )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.binary, self.workdir, self.maxmemory = found, workdir, maxmemory
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self, timeout_s: float = 10.0) -> None:
        import redis

        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.workdir,
                "--maxmemory",
                self.maxmemory,
                "--maxmemory-policy",
                "allkeys-lru",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        while True:  # readiness: wait until it answers
            try:
                client.ping()
                client.close()
                return
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RedisServerError(
                        f"redis-server on port {self.port} did not come up"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
