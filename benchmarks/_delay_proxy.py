"""A loopback TCP proxy that delays a store's replies, in a process of its own.

A network's round trip, or a store that stops answering, put in front of a
real server on this machine (``benchmarks/bench_vllm_latency.py``): the
engine under test talks to the proxy's port. Run as a script it serves one
proxy: ``python _delay_proxy.py TARGET_PORT DELAY_S``, printing its port, then
``hold`` / ``release`` read from stdin, each answered when done.
"""

from __future__ import annotations

import queue
import socket
import subprocess
import sys
import threading
import time


class DelayProxy:
    """A loopback TCP proxy whose replies (server to client) wait ``delay_s``
    each, and between :meth:`hold` and :meth:`release` wait for the release: a
    network's round trip, or a store that stops answering, before a real server."""

    def __init__(self, port: int, delay_s: float) -> None:
        self.target, self.delay_s = port, delay_s
        self.open = threading.Event()
        self.open.set()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self.open.clear()

    def release(self) -> None:
        self.open.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(
                target=self._pump, args=(server, client, self.delay_s), daemon=True
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        """Forward ``src`` to ``dst``, each chunk ``delay`` seconds after it came:
        a delay line (latency, not a bandwidth limit), read and sent apart."""
        line: queue.Queue[tuple[float, bytes] | None] = queue.Queue()

        def send() -> None:
            try:
                while (item := line.get()) is not None:
                    due, data = item
                    time.sleep(max(0.0, due - time.monotonic()))
                    self.open.wait()
                    dst.sendall(data)
            except OSError:
                pass

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            while data := src.recv(1 << 20):
                line.put((time.monotonic() + delay, data))
        except OSError:
            pass
        finally:
            line.put(None)
            sender.join()
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.open.set()
        self.sock.close()


class ProxyProcess:
    """:class:`DelayProxy` in a process of its own (its threads never contend
    with the engine's for this process's interpreter), told to hold and release
    over its stdin."""

    def __init__(self, port: int, delay_s: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(port), str(delay_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def _say(self, word: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == word  # done before the caller goes on

    def hold(self) -> None:
        self._say("hold")

    def release(self) -> None:
        self._say("release")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _serve_proxy(port: int, delay_s: float) -> None:
    proxy = DelayProxy(port, delay_s)
    print(proxy.port, flush=True)
    for line in sys.stdin:
        word = line.strip()
        getattr(proxy, word)()
        print(word, flush=True)
    proxy.close()


if __name__ == "__main__":
    _serve_proxy(int(sys.argv[1]), float(sys.argv[2]))
