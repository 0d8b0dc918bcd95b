"""Prefill in one process, decode in another: tokens equal one process alone.

The request's blocks and state travel with kvarena's NIXL sender (UCX). Where
the machine allows it (root, ``ip netns``), a second test runs the two sides
in two network namespaces joined by a veth pair it creates and removes, so
the bytes cross a network interface as between two hosts (and checks the
interface's counters saw them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kvarena.transfer import nixl_available

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL (kvarena[transfer]) not installed"
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_disaggregated.py"
sys.path.insert(0, str(EXAMPLE.parent))

import hf_disaggregated as example  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text", "llama"])
def test_handoff_between_two_processes(family):
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--family", family, "--tokens", "10"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "equal a single-process generate" in run.stdout


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _netns_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    probe = f"kvprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"ip netns is not allowed here: {getattr(exc, 'stderr', exc)!r}"
    _ip("netns", "del", probe)
    return None


def _rx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return int(out.stdout)


def _marked(lines, mark: str) -> str:
    """The rest of the first line starting with ``mark`` (NIXL logs to stdout too)."""
    for line in lines:
        if line.startswith(mark + " "):
            return line[len(mark) + 1 :].strip()
    raise AssertionError(f"no {mark!r} line")


def test_handoff_across_network_namespaces():
    reason = _netns_reason()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    ns_d, ns_p, dev_d, dev_p = f"kvd{tag}", f"kvp{tag}", f"kvd{tag}v", f"kvp{tag}v"
    # RFC 2544's benchmarking range (198.18.0.0/15), never routed, on a veth pair
    # in namespaces with no other interface and no route: nothing beyond the
    # two of them. Not link-local 169.254/16: UCX skips IPv4 link-local
    # addresses when it picks TCP interfaces (openucx/ucx#11504), so NIXL
    # could not connect over them.
    addr_d, addr_p = "198.18.77.1", "198.18.77.2"
    family, tokens = "qwen3_next", 10
    decode = None
    try:
        _ip("netns", "add", ns_d)
        _ip("netns", "add", ns_p)
        _ip("link", "add", dev_d, "type", "veth", "peer", "name", dev_p)
        _ip("link", "set", dev_d, "netns", ns_d)
        _ip("link", "set", dev_p, "netns", ns_p)
        for ns, dev, addr in ((ns_d, dev_d, addr_d), (ns_p, dev_p, addr_p)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        before = _rx_bytes(ns_d, dev_d)
        cmd = [sys.executable, str(EXAMPLE), "--family", family, "--tokens", str(tokens)]
        # UCX over TCP only: on one host UCX would otherwise pick shared memory
        # and the bytes would never touch the interface. Each namespace has its
        # own loopback, so the veth is the one route between the two sides.
        env = {**os.environ, "UCX_TLS": "tcp,self"}
        decode = subprocess.Popen(
            ["ip", "netns", "exec", ns_d, *cmd, "--role", "decode", "--bind", addr_d],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(os.devnull, "w") if not os.environ.get("KVARENA_DEBUG") else None,
            text=True,
        )
        assert decode.stdout is not None and decode.stdin is not None
        endpoint = _marked(decode.stdout, "endpoint")
        assert endpoint.startswith(f"tcp://{addr_d}:"), endpoint
        prefill = subprocess.run(
            ["ip", "netns", "exec", ns_p, *cmd, "--role", "prefill", "--endpoint", endpoint],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert prefill.returncode == 0, prefill.stderr[-3000:]
        shipped = json.loads(_marked(prefill.stdout.splitlines(), "result"))
        # Bounded: a transfer that never lands fails the test, never hangs the suite.
        rest, _ = decode.communicate(f"{shipped['first']}\n", timeout=240)
        got = json.loads(_marked(rest.splitlines(), "result"))["tokens"]
        assert decode.returncode == 0
        assert got == example.single(family, tokens)
        # The request's bytes arrived through the veth interface.
        _, pool = example._setup(family)
        shipped_bytes = shipped["blocks"] * pool.cache.block_bytes + pool.cache.slot_bytes
        assert _rx_bytes(ns_d, dev_d) - before >= shipped_bytes
    finally:
        if decode is not None and decode.poll() is None:
            decode.kill()
            decode.wait(10)
        for ns in (ns_d, ns_p):  # deleting a namespace removes its veth end
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
