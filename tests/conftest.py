"""Shared hypothesis strategies and byte helpers for the layout tests."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvarena import EntryField

settings.register_profile(
    "default", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("KVARENA_HYPOTHESIS_PROFILE", "default"))

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float64,
    torch.float8_e4m3fn,
]
FILLS = {
    torch.float32: [0.0, 1.5, -2.0, float("-inf")],
    torch.bfloat16: [0.0, 3.0, float("-inf")],
    torch.float16: [0.0, -1.0, float("inf")],
    torch.uint8: [0, 7, 255],
    torch.int32: [0, -5, 1 << 20],
    torch.int64: [0, -1],
    torch.float64: [0.0, 2.5],
    torch.float8_e4m3fn: [0.0, 1.0, -2.0],
}


@st.composite
def entry_field(draw, name: str, max_layers: int = 3, max_dim: int = 6) -> EntryField:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, max_dim), min_size=0, max_size=3)))
    return EntryField(
        name=name,
        layers=draw(st.integers(0, max_layers)),
        shape=shape,
        dtype=dtype,
        fill=draw(st.sampled_from(FILLS[dtype])),
        align=draw(st.sampled_from([0, 0, 0, 256, 512, 1024])),
        in_checkpoint=draw(st.booleans()),
    )


@st.composite
def field_lists(draw, min_size: int = 0, max_size: int = 6, **kw) -> list[EntryField]:
    n = draw(st.integers(min_size, max_size))
    return [draw(entry_field(f"f{i}", **kw)) for i in range(n)]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor's elements in logical (row-major) order."""
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def random_fill_(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill a (possibly strided) typed view with random bytes, element by element."""
    if t.numel() == 0:
        return
    noise = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    t.copy_(noise.view(t.dtype).view(t.shape))


def plan_for(
    page, state, budget: int, max_seqs: int, *, block_size: int = 16, entries_per_req: int = 1
):
    """The one road for hand-written layouts: ModelCache.from_fields -> plan_cache.

    ``clamp=False``: a test that asks for a concurrency gets exactly it, or fails.
    """
    from kvarena import ModelCache, plan_cache

    model = ModelCache.from_fields(
        page, state, block_size=block_size, entries_per_req=entries_per_req
    )
    return plan_cache(model, budget_bytes=budget, max_seqs=max_seqs, clamp=False)


def redis_binary() -> str:
    """redis-server's path; under CI (where the Makefile installs it) its absence fails."""
    from kvarena.testing.redis_server import find_redis_server

    path = find_redis_server()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing; `make test` installs Debian's redis-server")
        pytest.skip("redis-server is not installed (make test installs it)")
    pytest.importorskip("redis")
    return path


@pytest.fixture
def redis_server(tmp_path):
    from kvarena.testing.redis_server import RedisServer

    server = RedisServer(str(tmp_path), binary=redis_binary())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vllm_in_process():
    """vLLM engines built in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
    a test can ask the connector what it did; set for the module that asks for
    it and restored after, never at import time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


@pytest.fixture(autouse=True)
def vllm_groups_released(request):
    """After a test that built engines in this process, vLLM's process-wide
    state is as a fresh process has it: its parallel groups gone (an engine
    refused at start, a test of a bad setting, leaves them made for its model,
    and the next engine reuses them as they are — a MoE model then finds no
    expert group) and its environment read anew (an engine caches it when it
    starts). Otherwise a test's outcome depends on which ran before it on a
    worker."""
    yield
    if "vllm_in_process" not in request.fixturenames or "vllm" not in sys.modules:
        return
    from vllm import envs
    from vllm.distributed import parallel_state

    envs.disable_envs_cache()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
