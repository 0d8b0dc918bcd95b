"""A store that speaks Redis's protocol but answers with replies of the wrong kind:
every call is a miss or a dropped write with one warning, never a raw error — in
the tier, and in the prefix cache above it."""

from __future__ import annotations

import socket
import threading
import warnings

import pytest
from test_tier_prefix import compute, make, prompts
from test_tier_redis import images

from kvarena.tiers import Put, RedisTier, TierStack, TierWarning

pytest.importorskip("redis")

REPLIES = {
    "integer": b":7\r\n",
    "array": b"*2\r\n$1\r\na\r\n$1\r\nb\r\n",
    "nested": b"*1\r\n*1\r\n:1\r\n",
    "status": b"+WEIRD\r\n",
    "big integer": b":99999999999999999999999\r\n",
    "garbage": b"?what is this\r\n",
}


class WrongServer:
    """A TCP server on localhost that reads RESP commands and answers each with the
    same reply of the wrong kind."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.commands = 0
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        try:
            self._answer(conn)
        except (OSError, ValueError):
            return  # the client hung up mid-reply, or sent what this server does not parse

    def _answer(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while not self._stop:
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                buf += data
                while True:
                    n, buf = _one_command(buf)
                    if n is None:
                        break
                    self.commands += 1
                    conn.sendall(self.reply)

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def _one_command(buf: bytes) -> tuple[int | None, bytes]:
    """Split one RESP array of bulk strings off ``buf`` (None: not complete yet)."""
    if not buf.startswith(b"*") or b"\r\n" not in buf:
        return None, buf
    head, rest = buf.split(b"\r\n", 1)
    for _ in range(int(head[1:])):
        if b"\r\n" not in rest:
            return None, buf
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line[1:])
        if len(rest) < size + 2:
            return None, buf
        rest = rest[size + 2 :]
    return 1, rest


@pytest.fixture(params=sorted(REPLIES))
def wrong(request):
    server = WrongServer(REPLIES[request.param])
    yield server
    server.close()


@pytest.mark.parametrize("direct", [True, False])
def test_every_call_is_a_miss_with_one_warning(wrong, direct):
    objs = images(3)
    names = [o.name for o in objs]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tier = RedisTier(f"redis://127.0.0.1:{wrong.port}", timeout_s=2.0, direct_writes=direct)
        assert tier.put_many(objs) == Put(refused=names)  # no SET taken: none held
        got = tier.get_many(names)
        # A status reply reads as bytes, like a value (a GET that seems to work, so
        # the tier warns again after it): the image check above the tier refuses
        # those bytes (the prefix cache test below). Anything else is a miss.
        status = wrong.reply.startswith(b"+")
        assert all(g is None or isinstance(g, bytes) for g in got)
        assert got == [None] * 3 or status
        assert tier.contains_many(names) == [False] * 3
        assert tier.delete_many(names) == 0
        assert tier.used_bytes == 0 and tier.capacity_bytes == 0
    ours = [w for w in seen if issubclass(w.category, TierWarning)]
    assert len(ours) == 1 or (status and 1 <= len(ours) <= 3), [str(w.message) for w in seen]
    assert tier.metrics.failures >= (4 if status else 5) and tier.metrics.puts == 0
    assert wrong.commands > 0  # it really was asked
    tier.close()


def test_the_prefix_cache_above_it_serves_on(wrong):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TierWarning)
        pc = make(TierStack([RedisTier(f"redis://127.0.0.1:{wrong.port}", timeout_s=2.0)]))
        ps = prompts(3)
        for i, p in enumerate(ps):
            compute(pc, i, p)
        pc.drain()
        adm = compute(pc, "again", ps[0])
    assert adm.hit.tokens > 0 and set(adm.hit.sources) == {"device"}
    pc.check_books()
