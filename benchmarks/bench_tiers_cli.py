"""``kvarena tiers`` on a large disk directory, beside the raw reads it cannot avoid.

python benchmarks/bench_tiers_cli.py [--objects 20000] [--size 64KiB] [--rounds 3]

A disk tier writes ``--objects`` KV objects of ``--size`` payload each under
four namespaces; then, round by round and interleaved: ``stat`` (every
object's header: one small read per file) beside the raw cost of opening each
file and reading as many bytes, and ``verify`` (every object read whole and
checked: header, size, seal, xxh3 checksum, name) beside reading every byte
of every file. Ratios are kvarena's time over the raw one (paired per round): 1.0 is the raw speed. The files sit
in the page cache (just written), so this is the CPU's share, not the disk's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _timing import side_by_side

from kvarena.checks import parse_bytes
from kvarena.tiers import DiskTier, TierStack
from kvarena.tiers.checked import Expectations
from kvarena.tiers.image import HEAD_BYTES, MAX_NAMESPACE_BYTES
from kvarena.tiers.inventory import DiskInventory, check_alone
from kvarena.tiers.names import ImageKind


def fill(directory: Path, objects: int, size: int) -> None:
    tier = DiskTier(directory, objects * (size + 4096))
    stack = TierStack([tier])
    payload = memoryview(os.urandom(size))
    for ns in range(4):
        e = Expectations(
            namespace=json.dumps({"model": f"m{ns}", "tp": [0, 1]}).encode(),
            block_size=16,
            kv_bytes=size,
            state_bytes=size,
        )
        batch = []
        for i in range(ns, objects, 4):
            batch.append(e.encode(ImageKind.KV_BLOCK, i.to_bytes(16, "big"), i, [payload]))
            if len(batch) == 512:
                stack.write_through(batch)
                batch = []
        stack.write_through(batch)
    tier.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=20000)
    ap.add_argument("--size", default="64KiB")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    size = parse_bytes(args.size)
    with tempfile.TemporaryDirectory(prefix="kvarena-bench-tiers-cli-") as tmp:
        d = Path(tmp) / "disk"
        t0 = time.perf_counter()
        fill(d, args.objects, size)
        print(f"{args.objects:,} objects of {size:,} B written in {time.perf_counter() - t0:.1f} s")
        inv = DiskInventory(d)
        files = sorted(d.glob("*.kvi"))

        def stat() -> None:
            entries, bad = inv.entries()
            assert len(entries) == args.objects and not bad

        def raw_heads() -> None:
            for f in files:
                with open(f, "rb") as fh:
                    fh.read(HEAD_BYTES + MAX_NAMESPACE_BYTES)
                f.stat()

        def verify() -> None:
            for name, _, data in inv.contents():
                check_alone(name, data)

        def raw_read() -> None:
            for f in files:
                f.read_bytes()

        cpu = torch.device("cpu")
        heads = side_by_side({"stat": stat, "raw": raw_heads}, args.rounds, cpu)
        whole = side_by_side({"verify": verify, "raw": raw_read}, args.rounds, cpu)
        total = args.objects * size
        print(f"{'operation':<10} {'kvarena s':>10} {'raw s':>8} {'ratio':>7}  note")
        print(
            f"{'stat':<10} {heads['stat']:>10.3f} {heads['raw']:>8.3f} "
            f"{1 / heads.speed('stat', 'raw'):>6.2f}x  one header read per object"
        )
        print(
            f"{'verify':<10} {whole['verify']:>10.3f} {whole['raw']:>8.3f} "
            f"{1 / whole.speed('verify', 'raw'):>6.2f}x  {total / whole['verify'] / 1e9:.2f} GB/s checked, "
            f"{total / whole['raw'] / 1e9:.2f} GB/s read"
        )


if __name__ == "__main__":
    main()
