"""What the scheduler-side tests share: vLLM's own KV cache groups, a scheduler
side over an in-memory catalogue with a host tier, and requests as vLLM makes
them (hashed with its ``sha256`` where the side recalls keys by them). Imported
by ``test_vllm_scheduler_side.py`` and ``test_vllm_asked.py``; needs vLLM.
"""

from __future__ import annotations

import random

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request

from kvarena.integrations.vllm.catalogue import Catalogue
from kvarena.integrations.vllm.groups import classify
from kvarena.integrations.vllm.key_memo import trusted_hashes
from kvarena.integrations.vllm.scheduler_side import SchedulerSide
from kvarena.integrations.vllm.settings import ConnectorSettings

BS = 16
NS = b'{"model":"tiny"}'


def make_groups(*kinds: str):
    specs = {
        "kv": FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32),
        "state": MambaSpec(
            block_size=BS,
            shapes=((3, 32), (2, 8, 8)),
            dtypes=(torch.float32, torch.float32),
            mamba_cache_mode="align",
        ),
    }
    return classify(
        KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(layer_names=[f"layer.{i}"], kv_cache_spec=specs[k])
                for i, k in enumerate(kinds)
            ],
        )
    )


def make_side(*kinds: str, memo: bool = False) -> SchedulerSide:
    """``memo``: keys recalled by vLLM's block hashes (the requests must carry them)."""
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB"]})
    return SchedulerSide(
        groups=make_groups(*kinds),
        namespace=NS,
        catalogue=Catalogue(settings),
        block_size=BS,
        memo=trusted_hashes("sha256", BS, BS) if memo else None,
    )


def make_request(rid: str, n: int, seed: int = 0, tail: int = 0) -> Request:
    """``n`` tokens of ``seed``'s prompt; with ``tail``, its last ``tail`` tokens
    the request's own (``rid``'s), as vLLM hashes them (sha256) for ``make_side(memo=True)``."""
    tokens = [(seed * 7919 + i * 31) % 1000 + 1 for i in range(n - tail)]
    # the same in every run (``hash(rid)`` is salted per process: two requests'
    # tails once began alike in about one run in a hundred)
    rng = random.Random(f"tail of {rid}")
    tokens += [rng.randrange(1, 1001) for _ in range(tail)]
    if not tail:
        return Request(rid, tokens, SamplingParams(max_tokens=4), None)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, block_hasher=hasher)
