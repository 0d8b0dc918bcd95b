"""A prefix cache with host and disk tiers below the device, on the one road.

plan_cache -> PrefixCache(plan, device, tiers=TierStack([...])): the device
evicts into the host tier, the host tier into the disk tier; a later request
with the same prefix gets its KV blocks and its state image back from
whichever tier holds them, each object checked (checksum, namespace, key,
span, length) before a byte of it is copied.

    python examples/tiers.py
"""

from __future__ import annotations

import tempfile

import numpy as np

import kvarena
from kvarena.prefix import CheckpointPolicy
from kvarena.tiers import DiskTier, HostTier


def main() -> None:
    model = kvarena.model_cache("qwen3-next-80b-a3b", kvarena.ServingOptions(tp=8))
    plan = kvarena.plan_cache(model, budget_bytes=96 << 20, max_seqs=2)
    with tempfile.TemporaryDirectory() as disk_dir:
        tiers = kvarena.TierStack([HostTier(32 << 20), DiskTier(disk_dir, 1 << 30)])
        pc = kvarena.PrefixCache(
            plan, "cpu", policy=CheckpointPolicy.parse("interval:512,branch"), tiers=tiers
        )
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 150_000, size=2048) for _ in range(6)]
        for i, prompt in enumerate(prompts):  # more history than the device holds
            adm = pc.admit(i, prompt)
            # ... the model computes the prompt here, writing KV and state ...
            for point in adm.checkpoints:
                pc.checkpoint(i, point)
            pc.commit(i, prompt.size)
            pc.finish(i)
        hit = pc.lookup(prompts[0])
        print(
            f"first prompt again: {hit.tokens} of {prompts[0].size} tokens hit; KV from "
            f"{sorted(set(hit.sources))}, state image from {hit.image_source}"
        )
        for row in tiers.report():
            print(
                f"  {row['tier']}: {row['objects']} objects, {row['used_bytes']:,} of "
                f"{row['capacity_bytes']:,} B"
            )
        tiers.close()


if __name__ == "__main__":
    main()
