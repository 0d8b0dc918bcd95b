"""transformers generate with its cache in kvarena vs transformers' DynamicCache.

    python benchmarks/bench_hf_generate.py [--families llama,qwen3_next] [--rounds 5]

Two tables from one run, every method timed in interleaved rounds:

1. generate wall time (greedy, batch 1, 32 new tokens) at 20 and 1,000 prompt
   tokens: KvarenaCache / DynamicCache (goal <= 1.15x);
2. time to first token of a 1,040-token prompt whose first 1,024 tokens an
   earlier prompt computed: kvarena with prefix reuse (blocks shared, state
   image restored) / kvarena without reuse / DynamicCache (goal <= 0.3x).

Each generated sequence is also checked to equal DynamicCache's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).parent))
from _timing import side_by_side

from kvarena.integrations.transformers import KvarenaPool
from kvarena.integrations.transformers.tiny import tiny_model

# A model big enough that the cache is not all there is, small enough for CI
# machines: 4 layers of width 256 (Qwen3-Next: 3 Gated DeltaNet + 1 attention).
SIZE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    head_dim=32,
    num_key_value_heads=2,
    vocab_size=1024,
)
LINEAR = dict(
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
)
OVERRIDES = {
    "llama": dict(SIZE, num_hidden_layers=4),
    "qwen3_next": dict(SIZE, **LINEAR),
    "gemma3_text": dict(SIZE, sliding_window=128),
}


def _model(family: str):
    return tiny_model(family, **OVERRIDES.get(family, SIZE))


def _prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 1000, (1, length), generator=torch.Generator().manual_seed(seed))


def _generate_row(model, pool, length: int, rounds: int, new: int) -> tuple:
    ids = _prompt(length)
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    outs: dict[str, torch.Tensor] = {}

    def dynamic():
        outs["dynamic"] = model.generate(ids, cache=DynamicCache(config=model.config), **gen)

    def kvarena():
        cache = pool.new_cache(1)
        outs["kvarena"] = model.generate(ids, cache=cache, **gen)
        pool.release(cache)

    with torch.no_grad():
        t = side_by_side({"dynamic": dynamic, "kvarena": kvarena}, rounds, pool.device)
    same = torch.equal(outs["dynamic"], outs["kvarena"])
    return length, t["kvarena"], t["dynamic"], same


def generate_table(families: list[str], rounds: int, new: int) -> list[tuple]:
    rows = []
    for family in families:
        model = _model(family)
        pool = KvarenaPool.from_config(
            model.config, budget_bytes=256 << 20, max_seqs=4, dtype=model.dtype
        )
        for length in (20, 1000):
            length, kv, dyn, same = _generate_row(model, pool, length, rounds, new)
            rows.append((family, length, new, kv, dyn, kv / dyn, same))
    return rows


def _ttft_row(family: str, rounds: int) -> tuple:
    model = _model(family)
    shared = _prompt(1024, seed=1)
    gen = dict(max_new_tokens=1, do_sample=False)
    pools = {
        reuse: KvarenaPool.from_config(
            model.config, budget_bytes=256 << 20, max_seqs=4, dtype=model.dtype
        )
        for reuse in (True, False)
    }
    pools[False].prefix.enabled = False  # prefix caching off: every lookup misses
    first = torch.cat([shared, _prompt(16, seed=2)], dim=1)
    warm = pools[True].prefill(model, first)
    model.generate(first, cache=warm, **gen)
    pools[True].release(warm)
    outs: dict[str, torch.Tensor] = {}
    seeds = iter(range(100, 10_000))

    def prompt() -> torch.Tensor:
        # A new suffix each time: only the 1,024 shared tokens can hit.
        return torch.cat([shared, _prompt(16, seed=next(seeds))], dim=1)

    def run(reuse: bool) -> None:
        ids = prompt()
        cache = pools[reuse].prefill(model, ids)
        outs[f"kv{reuse}"] = model.generate(ids, cache=cache, **gen)
        pools[reuse].release(cache)
        outs[f"ids{reuse}"] = ids

    def dynamic() -> None:
        outs["dyn"] = model.generate(prompt(), cache=DynamicCache(config=model.config), **gen)

    methods = {"reuse": lambda: run(True), "no reuse": lambda: run(False), "dynamic": dynamic}
    with torch.no_grad():
        t = side_by_side(methods, rounds, pools[True].device)
        ref = model.generate(outs["idsTrue"], cache=DynamicCache(config=model.config), **gen)
    same = torch.equal(outs["kvTrue"], ref)
    m = pools[True].prefix.metrics
    hit = m.hit_tokens // max(1, m.hits)
    r, nr, dyn = t["reuse"], t["no reuse"], t["dynamic"]
    return family, hit, r, nr, dyn, r / nr, r / dyn, same


def ttft_table(families: list[str], rounds: int) -> list[tuple]:
    return [_ttft_row(family, rounds) for family in families]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="llama,qwen3_next,gemma3_text")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args()
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    families = a.families.split(",")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {a.rounds} rounds"
    )
    print("\ngenerate wall time, batch 1, greedy (goal: kvarena / DynamicCache <= 1.15)")
    print(
        f"{'family':12s} {'prompt':>6s} {'new':>4s} {'kvarena':>9s} {'Dynamic':>9s} {'ratio':>6s}  same"
    )
    ok = True
    for fam, length, new, kv, dyn, ratio, same in generate_table(families, a.rounds, a.new_tokens):
        ok &= same
        print(
            f"{fam:12s} {length:6d} {new:4d} {kv * 1e3:7.1f}ms {dyn * 1e3:7.1f}ms {ratio:6.2f}  {same}"
        )
    print("\ntime to first token, 1,040-token prompt sharing 1,024 tokens with an earlier one")
    print("(goal: with reuse / without <= 0.3)")
    print(
        f"{'family':12s} {'hit':>5s} {'reuse':>9s} {'no reuse':>9s} {'Dynamic':>9s} "
        f"{'/no reuse':>9s} {'/Dynamic':>9s}  same"
    )
    for fam, hit, r, nr, dyn, r1, r2, same in ttft_table(families, a.rounds):
        ok &= same
        print(
            f"{fam:12s} {hit:5d} {r * 1e3:7.1f}ms {nr * 1e3:7.1f}ms {dyn * 1e3:7.1f}ms "
            f"{r1:9.2f} {r2:9.2f}  {same}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
