"""The main job's checks of the floors above the layout: tiers, transformers, transfer.

Each runs the real component (a disk and a host tier, a tiny transformers
model generating with its cache in a pool, a prefill and a decode process
over NIXL) and checks bytes or tokens against a reference.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..layout import min_slot_stride
from ..layout.regions import align_up
from ..models import ServingOptions, model_cache
from ..pools import plan_cache
from .records import Check


def _tier_checks(model: str, tp: int) -> Iterator[Check]:
    """Replay four chats through a device too small for them, with host and disk
    tiers below it: what the device evicts comes back, every byte checked."""
    import tempfile

    import numpy as np

    from ..prefix import CheckpointPolicy
    from ..replay import ReplayConfig, TraceRequest, replay

    preset = model_cache(model, ServingOptions(tp=tp))
    if not (preset.page_fields and preset.state_fields):
        return
    system = np.arange(1024)
    requests, t = [], 0.0
    for turn in range(3):  # turn-major: each chat's history is evicted before it returns
        for chat in range(4):
            own = 10**6 * (chat + 1) + np.arange(512 * (turn + 1))
            requests.append(
                TraceRequest(arrival_ms=t, tokens=np.concatenate([system, own]), output_tokens=4)
            )
            t += 1000.0
    slot = min_slot_stride(preset.state_fields)
    per_token = min_slot_stride(preset.page_fields) / preset.block_size
    budget = align_up(int(2 * (2560 * per_token + 2 * slot)), 1 << 20)  # about two requests
    with tempfile.TemporaryDirectory(prefix="kvarena-demo-") as d:
        cfg = ReplayConfig(
            budget_bytes=budget,
            max_seqs=2,
            verify=True,
            policy=CheckpointPolicy.parse("end,end:512,branch"),
            tiers=(f"host:{budget // 4}", f"disk:{d}:{4 * budget}"),
        )
        r = replay(preset, requests, cfg)
    by_tier = r.metrics["tier_hit_tokens"]
    yield Check(
        "host + disk tiers",
        r.mismatches == 0 and sum(by_tier.values()) > 0 and r.verified_blocks > 0,
        f"{budget:,} B device: {r.hit_tokens:,} hit tokens, "
        + ", ".join(f"{v:,} from {k}" for k, v in sorted(by_tier.items()))
        + f"; {r.verified_blocks:,} blocks and {r.verified_states} states checked, "
        f"{r.mismatches} wrong",
    )


def _hf_checks() -> Iterator[Check]:
    """A tiny random Qwen3-Next generates with its cache in a kvarena pool: the same
    tokens as with transformers' own cache, then again after a prefix restore."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the reference kernels' fallback notices
    try:
        yield from _hf_generate()
    finally:
        hf_logging.set_verbosity(verbosity)


def _hf_generate() -> Iterator[Check]:
    from transformers import DynamicCache

    from ..integrations.transformers import KvarenaPool
    from ..integrations.transformers.tiny import tiny_model

    model = tiny_model("qwen3_next")
    pool = KvarenaPool.from_config(model.config, budget_bytes=16 << 20, dtype=model.dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 128, (2, 40), generator=gen)
    greedy = dict(max_new_tokens=16, do_sample=False)
    want = model.generate(prompts, cache=DynamicCache(config=model.config), **greedy)
    cache = pool.new_cache(2)
    got = model.generate(prompts, cache=cache, **greedy)
    pool.release(cache)
    yield Check(
        "transformers generate",
        torch.equal(got, want),
        f"tiny Qwen3-Next, batch 2: {got.shape[1] - prompts.shape[1]} tokens each, "
        "identical to DynamicCache",
    )
    same = True
    for prompt in (prompts[:1], torch.cat([prompts[:1, :36], prompts[1:, :8]], dim=1)):
        cache = pool.prefill(model, prompt)
        got = model.generate(prompt, cache=cache, **greedy)
        pool.release(cache)
        ref = model.generate(prompt, cache=DynamicCache(config=model.config), **greedy)
        same &= torch.equal(got, ref)
    m = pool.prefix.metrics
    back = pool.cache.blocks.num_live == 0 and pool.cache.slots.num_free == pool.cache.num_slots
    yield Check(
        "transformers prefix reuse",
        same and m.hit_tokens > 0 and m.images_read > 0 and back,
        f"second prompt: {m.hit_tokens} tokens reused, state image restored, same tokens; "
        "every block and slot returned",
    )


def _transfer_checks(model: str, tp: int) -> Iterator[Check]:
    """Ship requests from a prefill process to a decode process over NIXL."""
    from ..transfer import nixl_available
    from ..transfer.local_pair import SideProcess, connect_pair, ship_request

    preset = model_cache(model, ServingOptions(tp=tp))
    if not nixl_available() or not preset.page_fields:
        return
    slot = min_slot_stride(preset.state_fields)
    total = align_up(40 * min_slot_stride(preset.page_fields) + 4 * slot, 1 << 20)
    plan = plan_cache(preset, budget_bytes=total, max_seqs=3, clamp=False)
    prefill, decode = SideProcess("prefill", plan), SideProcess("decode", plan)
    try:
        peer, _ = connect_pair(prefill, decode)
        shipped = [
            ship_request(prefill, decode, peer, f"req-{i}", 4 + 3 * i, 1000 * i) for i in range(2)
        ]
        exact = all(r["byte_exact"] for r in shipped) and decode.call("untouched")
        descriptors = [r["descriptors"] for r in shipped]
    finally:
        codes = (prefill.stop(), decode.stop())
    yield Check(
        "prefill -> decode transfer",
        exact and codes == (0, 0),
        f"2 requests over NIXL between two processes, {descriptors} descriptors, byte-exact, "
        "nothing outside their allocation written",
    )
