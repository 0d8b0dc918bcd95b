"""A real ``redis-server`` on a free localhost port, for tests and benchmarks.

The shared tier is tested against the server users run, not a mock: Debian's
package (``make test`` installs it when missing). The server keeps nothing on
disk, binds to 127.0.0.1 only, and evicts with ``allkeys-lru`` under
``maxmemory`` — the configuration the README asks of a shared store. ``stop``
and ``start`` keep the port, so a test can take the store away mid-run and
bring it back.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.parse

from ..errors import Error


class RedisServerError(Error, RuntimeError):
    """redis-server is missing or did not come up."""


def find_redis_server() -> str | None:
    return shutil.which("redis-server")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port(*, with_bus: bool) -> int:
    if not with_bus:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 <= 65535 and _free(port + 10000):
            return port
        port = secrets.randbelow(55535 - 20000) + 20000
        if _free(port) and _free(port + 10000):
            return port
    raise RedisServerError("no free port pair (port, port + 10000) for a cluster node")


class RedisServer:
    def __init__(
        self,
        workdir: str,
        *,
        maxmemory: str = "256mb",
        binary: str | None = None,
        extra: tuple[str, ...] = (),
        password: str | None = None,
    ) -> None:
        """``password``: the server asks clients for it (``requirepass``), and
        ``url`` carries it as redis-py reads it (``redis://:PASSWORD@...``)."""
        found = binary or find_redis_server()
        if found is None:
            raise RedisServerError(
                "redis-server is not installed (Debian: apt install redis-server)"
            )
        # A cluster node also listens on port + 10000 (its bus), so it needs both.
        self.port = _free_port(with_bus="--cluster-enabled" in extra)
        self.binary, self.workdir, self.maxmemory, self.extra = found, workdir, maxmemory, extra
        self.password = password
        auth = f":{urllib.parse.quote(password, safe='')}@" if password is not None else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
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
                *self.extra,
                *(("--requirepass", self.password) if self.password is not None else ()),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, password=self.password, socket_connect_timeout=0.2)
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


class RedisCluster:
    """A Redis Cluster on localhost: ``nodes`` primaries, each with ``replicas``
    replicas, made with ``redis-cli --cluster create``; ``url`` is the tier
    spec that reaches it. ``node_timeout_ms``: how long a silent primary is
    waited for before its replica is promoted (Redis's own default, 15 s,
    where None)."""

    def __init__(
        self,
        workdir: str,
        *,
        nodes: int = 3,
        replicas: int = 0,
        binary: str | None = None,
        node_timeout_ms: int | None = None,
    ) -> None:
        self.servers: list[RedisServer] = []
        extra: tuple[str, ...] = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        if node_timeout_ms is not None:
            extra += ("--cluster-node-timeout", str(node_timeout_ms))
        try:
            for i in range(nodes * (1 + replicas)):
                where = os.path.join(workdir, f"node{i}")
                os.makedirs(where, exist_ok=True)
                self.servers.append(RedisServer(where, binary=binary, extra=extra))
            cli = shutil.which("redis-cli")
            if cli is None:
                raise RedisServerError("redis-cli is not installed (Debian: redis-tools)")
            addrs = [f"127.0.0.1:{s.port}" for s in self.servers]
            done = subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *addrs,
                    "--cluster-yes",
                    "--cluster-replicas",
                    f"{replicas}",
                ],
                capture_output=True,
                timeout=60,
            )
            if done.returncode:
                raise RedisServerError(
                    f"redis-cli --cluster create failed: {(done.stdout + done.stderr)[-300:]!r}"
                )
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        self.url = f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    def primaries(self) -> list[RedisServer]:
        """The servers that are primaries now (a promoted replica among them)."""
        import redis

        out = []
        for s in self.servers:
            if s.proc is None:
                continue
            client = redis.Redis(port=s.port)
            try:
                if client.info("replication").get("role") == "master":
                    out.append(s)
            finally:
                client.close()
        return out

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says the cluster is whole (a failover done)."""
        self._wait_ok(timeout_s)

    def _wait_ok(self, timeout_s: float = 20.0) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        for s in self.servers:
            if s.proc is None:  # stopped (a primary killed)
                continue
            client = redis.Redis(port=s.port)
            # whole, and every replica in sync with its primary (a replica that never
            # was is not promoted when its primary dies)
            while client.cluster("info").get("cluster_state") != "ok" or (
                client.info("replication").get("master_link_status", "up") != "up"
            ):
                if time.monotonic() > deadline:
                    raise RedisServerError("the cluster did not reach cluster_state:ok")
                time.sleep(0.05)
            client.close()

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
