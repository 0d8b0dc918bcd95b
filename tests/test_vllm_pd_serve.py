"""Prefill -> decode disaggregation behind ``vllm serve``, driven by a real router.

Two ``vllm serve`` processes of the hybrid tiny Qwen3-Next (Gated DeltaNet +
attention), a ``kv_producer`` and a ``kv_consumer`` configured by
``--kv-transfer-config`` JSON alone, and ``vllm-router`` in its PD mode in
front of them, unchanged: it sends each completion to the prefill server with
``do_remote_decode``, copies the ``kv_transfer_params`` of its answer into the
request it sends the decode server, and returns the decode server's answer.
An HTTP client sees tokens equal to one engine alone; each server's own
Prometheus counters say it did its half: the prefill server computed each
prompt less its last token, the decode server read those from another
instance (``p2p``) and computed the last token alone.

Each server is bound to a core of its own (``VLLM_CPU_OMP_THREADS_BIND``):
vLLM's CPU workers spin their OpenMP threads between steps, and two servers
sharing the machine's cores starve each other's side channel (measured: the
decode side's asks ran late and it recomputed; no wrong token).

The reference is the split the two servers make of a hybrid prompt (see
``test_vllm_pd.py``): one engine computing its first ``N - 1`` tokens in one
step, then the last. Runs in ``.venv-vllm``; skipped where vLLM, NIXL or
``vllm-router`` is missing.
"""

from __future__ import annotations

import concurrent.futures
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from kvarena.integrations.transformers.tiny import save_tiny  # noqa: E402
from kvarena.testing.vllm_engine import split_args  # noqa: E402
from kvarena.testing.vllm_pair import EngineProcess  # noqa: E402
from kvarena.testing.vllm_server import PORT_TRIES, VllmServer, free_port  # noqa: E402
from kvarena.transfer import nixl_available  # noqa: E402

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = [
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
    pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed"),
]
OUT = 8
rng = random.Random(11)
# one length: the split reference is one engine for both (an engine per length)
PROMPTS = [[rng.randrange(3, 500) for _ in range(517)] for _ in range(2)]


def config(role: str) -> dict:
    """What an operator passes as ``--kv-transfer-config``: the role, nothing more."""
    return {
        "kv_connector": "KvarenaConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {},
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny("qwen3_next", tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def reference(model):
    """Each prompt's greedy tokens from one engine computing it as the two servers
    split it (its first ``N - 1`` tokens, then the last)."""
    (n,) = {len(p) for p in PROMPTS}
    engine = EngineProcess(split_args(model, n))
    try:
        return [a.tokens for a in engine.generate(PROMPTS, max_tokens=OUT)]
    finally:
        engine.stop()


class Router:
    """``vllm-router --vllm-pd-disaggregation`` on a free loopback port."""

    def __init__(self, prefill: str, decode: str, log_path: Path) -> None:
        self.log_path = log_path
        cmd = [str(ROUTER), "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode]
        cmd += ["--policy", "round_robin", "--disable-retries", "--host", "127.0.0.1"]
        for tries_left in reversed(range(PORT_TRIES)):  # a free port is free until taken
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self._log = open(log_path, "wb")
            self.proc = subprocess.Popen(
                [*cmd, "--port", str(port)], stdout=self._log, stderr=subprocess.STDOUT
            )
            if self._healthy():
                return
            self.stop()
            log = self.log_path.read_text(errors="replace")
            if not tries_left or "in use" not in log:
                raise AssertionError(f"vllm-router did not serve:\n{log[-2000:]}")

    def _healthy(self) -> bool:
        import httpx

        for _ in range(240):
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        return False

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def served(model, reference, tmp_path_factory):
    """The two servers (one core each) and the router in front of them."""
    logs = tmp_path_factory.mktemp("logs")

    def start(role: str, core: int) -> VllmServer:
        return VllmServer(
            model,
            logs / f"{role}.log",
            kv_transfer_config=config(role),
            options=("--enable-prompt-tokens-details",),
            env={"VLLM_CPU_OMP_THREADS_BIND": str(core)},
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, "kv_producer", 0), pool.submit(start, "kv_consumer", 1)]
        servers = [f.exception() or f.result() for f in futures]
    started = [s for s in servers if isinstance(s, VllmServer)]
    if len(started) < 2:
        for s in started:
            s.stop()
        raise next(s for s in servers if not isinstance(s, VllmServer))
    prefill, decode = started
    router = None
    try:
        router = Router(prefill.url, decode.url, logs / "router.log")
        yield router, prefill, decode
    finally:
        if router is not None:
            router.stop()
        prefill.stop()
        decode.stop()


def complete(url: str, model, prompt: list[int]) -> tuple[list[int], int]:
    import httpx

    body = {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": OUT,
        "temperature": 0,
        "return_token_ids": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    details = answer["usage"].get("prompt_tokens_details") or {}
    return list(answer["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)


def by_source(server: VllmServer, name: str) -> dict[str, float]:
    """A counter of vLLM's on the server's ``/metrics``, by its ``source`` label."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name + "_total":
                out[s.labels["source"]] = out.get(s.labels["source"], 0.0) + s.value
    return out


def test_a_router_in_front_of_two_servers_hands_the_prompt_over(served, model, reference):
    router, prefill, decode = served
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        tokens, cached = complete(router.url, model, prompt)
        assert tokens == expected, prompt[:4]
        # vLLM's usage echoes the prefill engine's own cache hits (none: new prompts)
        assert cached == 0
    # each server did its half, as its own metrics say: the prefill server
    # computed every prompt less its last token, the decode server read those
    # from another vLLM instance (p2p) and computed the last tokens
    read = sum(len(p) - 1 for p in PROMPTS)
    made = by_source(prefill, "vllm:prompt_tokens_by_source")
    assert made["local_compute"] == read, made
    taken = by_source(decode, "vllm:prompt_tokens_by_source")
    assert taken["external_kv_transfer"] == read and taken["local_compute"] == len(PROMPTS), taken
    hits = by_source(decode, "vllm:prompt_tokens_cached_by_source")
    assert hits["p2p"] == read, hits
