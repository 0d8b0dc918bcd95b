"""A transformers model generates with its cache in a kvarena pool.

    python examples/hf_generate.py [--family qwen3_next]

One pool (the one road: hf_layout -> plan_cache -> PrefixCache) serves a
batch of two left-padded prompts, a beam search, and a second prompt that
reuses the first one's prefix; each is checked token for token against
transformers' own DynamicCache.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache
from transformers.utils import logging as hf_logging

from kvarena.integrations.transformers import KvarenaPool
from kvarena.integrations.transformers.tiny import TINY, tiny_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3_next", choices=sorted(TINY))
    a = ap.parse_args()
    hf_logging.set_verbosity_error()
    model = tiny_model(a.family)
    pool = KvarenaPool.from_config(model.config, budget_bytes=32 << 20, dtype=model.dtype)
    plan = pool.plan
    print(
        f"{a.family}: {plan.blocks} blocks of {plan.block_size} tokens, "
        f"{plan.state_slots} state slots in {plan.budget_bytes >> 20} MiB "
        f"({', '.join(f.name for f in (*plan.page_fields, *plan.state_fields))})"
    )

    def reference(ids, mask=None, **gen):
        cache = DynamicCache(config=model.config)
        return model.generate(ids, attention_mask=mask, cache=cache, **gen)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :6], mask[0, :6] = 0, 0  # row 0 left-padded
    ok = True
    for label, rows, gen in (
        ("greedy, batch 2 left-padded", 2, dict(max_new_tokens=20, do_sample=False)),
        ("beam search, 3 beams", 3, dict(max_new_tokens=12, num_beams=3, do_sample=False)),
    ):
        batch = ids if rows == 2 else ids[1:]
        m = mask if rows == 2 else mask[1:]
        cache = pool.new_cache(rows)
        got = model.generate(batch, attention_mask=m, cache=cache, **gen)
        pool.release(cache)
        same = torch.equal(got, reference(batch, m, **gen))
        ok &= same
        print(f"  {label:32s} {'identical to DynamicCache' if same else 'DIFFERENT'}")

    greedy = dict(max_new_tokens=20, do_sample=False)
    first = ids[1:, :]
    second = torch.cat([first[:, :26], torch.randint(3, 128, (1, 7), generator=g)], dim=1)
    for label, prompt in (("prompt A, cold", first), ("prompt B, shares 26 tokens", second)):
        before = pool.prefix.metrics.hit_tokens
        cache = pool.prefill(model, prompt)
        got = model.generate(prompt, cache=cache, **greedy)
        pool.release(cache)
        same = torch.equal(got, reference(prompt, **greedy))
        ok &= same
        hit = pool.prefix.metrics.hit_tokens - before
        print(
            f"  {label:32s} {hit:3d} tokens reused, "
            f"{'identical to an uncached run' if same else 'DIFFERENT'}"
        )
    c = pool.cache
    back = c.blocks.num_live == 0 and c.slots.num_free == c.slots.capacity
    print(f"  every block and slot returned: {back}")
    return 0 if ok and back else 1


if __name__ == "__main__":
    raise SystemExit(main())
