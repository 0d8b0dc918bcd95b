"""kvarena behind ``vllm serve``, as an operator runs it, through a real client.

Two server processes over one disk directory and one Redis (behind a
password, which the config names as ``${KVARENA_STORE_PASSWORD}``, an
environment variable of the server's: the server's log never holds it):

1. The connector inside vLLM's ``MultiConnector`` beside another connector,
   configured by ``--kv-transfer-config`` JSON alone (no module path: vLLM
   finds it by name through kvarena's plugin). An OpenAI client sends
   prompts; the outputs equal vLLM's own; a Prometheus scrape of
   ``/metrics`` shows every ``vllm:kvarena_*`` counter equal to what those
   prompts did (objects and bytes checked against the disk directory itself).
   Then the shared store's writes are paused (``CLIENT PAUSE ... WRITE``),
   a prompt is answered, and the server is stopped with SIGINT at once: the
   store holds every block the answer computed (the connector wrote its queue
   before the worker exited).
2. A restarted server with the connector alone over the same disk: the first
   prompt again is a tier hit (``usage.prompt_tokens_details.cached_tokens``),
   its tokens unchanged, and the scrape counts the hit tokens and the bytes
   loaded from the disk tier; the prompt answered just before SIGINT hits
   every block it computed.

Runs in ``.venv-vllm``; skipped where vLLM is not installed.
"""

from __future__ import annotations

import random
import signal
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from kvarena.integrations.transformers.tiny import save_tiny  # noqa: E402
from kvarena.testing.vllm_engine import engine_args, freeze_heap  # noqa: E402
from kvarena.testing.vllm_server import VllmServer  # noqa: E402

BLOCK = 32
OUT = 8
BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
rng = random.Random(5)
FIRST = [rng.randrange(3, 500) for _ in range(200)]
SECOND = FIRST[:128] + [rng.randrange(3, 500) for _ in range(100)]  # shares 4 blocks
THIRD = [rng.randrange(3, 500) for _ in range(300)]


def blocks_computed(prompt: list[int]) -> int:
    """Full blocks a request computes (its last sampled token is never fed back)."""
    return (len(prompt) + OUT - 1) // BLOCK


def tails(prompt: list[int]) -> int:
    """Partial blocks a prompt saves: its last, where it ends off a boundary
    (a prompt under one block saves none)."""
    return int(len(prompt) >= BLOCK and len(prompt) % BLOCK != 0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def reference(model):
    """vLLM alone's greedy tokens for each prompt (an offline engine, same options)."""
    from vllm import LLM, SamplingParams

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        freeze_heap()
        llm = LLM(**engine_args(model, block_size=BLOCK, distributed_executor_backend="uni"))
        params = SamplingParams(max_tokens=OUT, temperature=0, detokenize=False)
        out = {}
        for name, p in (("first", FIRST), ("second", SECOND), ("third", THIRD)):
            o = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            out[name] = list(o.outputs[0].token_ids)
        llm.llm_engine.engine_core.shutdown()
    return out


def complete(client, model, prompt):
    r = client.completions.create(
        model=str(model),
        prompt=prompt,
        max_tokens=OUT,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    details = r.usage.prompt_tokens_details
    return list(r.choices[0].token_ids), (details.cached_tokens if details else 0) or 0


def scrape(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every kvarena sample on ``/metrics``: (name, labels without vLLM's) -> value."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:kvarena_"):
                labels = tuple(
                    sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name"))
                )
                out[(s.name, labels)] = s.value
    return out


def kvarena_config(disk: Path, redis_url: str | None = None) -> dict:
    tiers = ["host:64MiB", f"disk:{disk}:256MiB"] + ([redis_url] if redis_url else [])
    return {
        "kv_connector": "KvarenaConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tiers": tiers},
    }


def settle(server, client, model, want: dict) -> dict:
    """The scrape once every ``want`` key has its value. vLLM hands a step's
    stats to its loggers with that step's output, and a worker's report of a
    write rides on the step after the write: an idle engine takes no step, so
    a one-token request (no lookup: nothing to look up) nudges one. Bounded:
    a count that never arrives fails with what the scrape shows."""
    got: dict = {}
    for _ in range(60):
        got = scrape(server)
        if all(got.get(k) == v for k, v in want.items()):
            return got
        client.completions.create(model=str(model), prompt=[5], max_tokens=1, temperature=0)
    wrong = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    raise AssertionError(f"kvarena metrics (got, want): {wrong}")


PASSWORD = "s3cret:w/@rd"


@pytest.fixture
def guarded_store(tmp_path):
    """The shared store behind a password (``requirepass``), as a fleet's is."""
    from conftest import redis_binary

    from kvarena.testing.redis_server import RedisServer

    server = RedisServer(str(tmp_path), binary=redis_binary(), password=PASSWORD)
    yield server
    server.stop()


def test_serve_metrics_shutdown_and_restart(model, reference, tmp_path, guarded_store):
    import openai
    import redis

    disk = tmp_path / "disk"
    # the password in the server's environment, named in the config: never in its log
    url = f"redis://:${{KVARENA_STORE_PASSWORD}}@127.0.0.1:{guarded_store.port}"
    store = redis.Redis(host="127.0.0.1", port=guarded_store.port, password=PASSWORD)
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                kvarena_config(disk, url),
                {
                    "kv_connector": "NoopConnector",
                    "kv_connector_module_path": "noop_connector",
                    "kv_role": "kv_both",
                },
            ]
        },
    }
    env = {"PYTHONPATH": ":".join([BENCHMARKS, *sys.path]), "KVARENA_STORE_PASSWORD": PASSWORD}
    server = VllmServer(
        model,
        tmp_path / "first.log",
        kv_transfer_config=multi,
        options=("--enable-prompt-tokens-details", "--shutdown-timeout", "60"),
        env=env,
        block_size=BLOCK,
    )
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert complete(client, model, FIRST) == (reference["first"], 0)
        tokens, cached = complete(client, model, SECOND)
        assert tokens == reference["second"] and cached == 128  # vLLM's own device cache
        # SECOND saves from the first block the device did not hold
        saved = blocks_computed(FIRST) + blocks_computed(SECOND) - 128 // BLOCK
        saved += tails(FIRST) + tails(SECOND)
        got = settle(server, client, model, {("vllm:kvarena_objects_saved_total", ()): saved})
        files = sorted(disk.glob("*.kvi"))
        on_disk = sum(f.stat().st_size for f in files)
        assert len(files) == saved
        tier = {t: (("tier", t),) for t in ("host", "disk", "redis")}
        assert got[("vllm:kvarena_lookups_total", ())] == 2
        assert got[("vllm:kvarena_save_bytes_total", tier["disk"])] == on_disk
        assert got[("vllm:kvarena_save_bytes_total", tier["host"])] == on_disk
        assert got[("vllm:kvarena_save_bytes_total", tier["redis"])] == on_disk
        assert got[("vllm:kvarena_held_objects", tier["disk"])] == saved
        assert got[("vllm:kvarena_held_bytes", tier["disk"])] == on_disk
        assert got[("vllm:kvarena_held_objects", tier["host"])] == saved
        assert got[("vllm:kvarena_save_seconds_count", tier["redis"])] >= 1
        assert got.get(("vllm:kvarena_saves_skipped_total", ()), 0) == 0
        assert not any(n.startswith("vllm:kvarena_load_") and v for (n, _), v in got.items())

        # The store's writes paused (under the tier's 2 s socket timeout): the
        # answer returns while its saves wait in the writer's queue; SIGINT at once.
        before = len(list(store.scan_iter(match="*kv-*")))
        assert before == saved
        store.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
        assert complete(client, model, THIRD) == (reference["third"], 0)
        server.stop(signal.SIGINT)
    finally:
        server.stop(signal.SIGKILL)
    assert len(list(store.scan_iter(match="*kv-*"))) == before + blocks_computed(THIRD) + tails(
        THIRD
    )
    assert "saves not written" not in server.log
    assert "KVARENA_STORE_PASSWORD" in server.log and PASSWORD not in server.log

    again = VllmServer(
        model,
        tmp_path / "second.log",
        kv_transfer_config=kvarena_config(disk),
        options=("--enable-prompt-tokens-details",),
        block_size=BLOCK,
    )
    try:
        client = openai.OpenAI(base_url=again.url + "/v1", api_key="none", max_retries=0)
        hit = len(FIRST) - 1  # its partial last block too
        assert complete(client, model, FIRST) == (reference["first"], hit)
        per_object = on_disk // saved  # every object a KV block of the same size
        disk_tier = (("tier", "disk"),)
        settle(
            again,
            client,
            model,
            {
                ("vllm:kvarena_lookups_total", ()): 1,
                ("vllm:kvarena_hit_tokens_total", disk_tier): hit,
                ("vllm:kvarena_load_bytes_total", disk_tier): (hit // BLOCK + 1) * per_object,
                ("vllm:kvarena_load_seconds_count", disk_tier): 1,
            },
        )
        # the answer given just before SIGINT: every block it computed is here
        tokens, cached = complete(client, model, THIRD)
        assert tokens == reference["third"] and cached == len(THIRD) - 1
    finally:
        again.stop(signal.SIGTERM)
