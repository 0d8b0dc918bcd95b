"""What an idle or waiting NIXL agent costs: its process's CPU share, side by side.

A side progresses its UCX worker every ``IDLE_POLL_S`` while nothing happens
(a command wakes it at once). This measures each side's CPU seconds over wall
seconds while it is idle and while the decode side waits on a request that
never comes, as a share of one core (a busy-poll loop would show 1.0; the
process's CPU clock ticks at 10 ms, so runs of a few seconds resolve about
0.5%). Wall-clock measurements belong here, not in the test suite.

    .venv/bin/python benchmarks/bench_idle_agent.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import time

from kvarena import plan_cache
from kvarena.layout import align_up, min_slot_stride
from kvarena.models import ServingOptions, model_cache
from kvarena.transfer import nixl_available
from kvarena.transfer.local_pair import HarnessError, SideProcess, connect_pair
from kvarena.transfer.pair_side import IDLE_POLL_S


def cpu_share(proc: SideProcess, run) -> float:
    cpu, wall = proc.cpu_seconds(), time.monotonic()
    run()
    return (proc.cpu_seconds() - cpu) / (time.monotonic() - wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    if not nixl_available():
        raise SystemExit("NIXL is not installed (pip install -e '.[transfer]')")
    m = model_cache("qwen3-next-80b-a3b", ServingOptions(tp=8))
    total = align_up(
        64 * min_slot_stride(m.page_fields) + 4 * min_slot_stride(m.state_fields), 1 << 20
    )
    plan = plan_cache(m, budget_bytes=total, max_seqs=2, clamp=False)
    prefill, decode = SideProcess("prefill", plan), SideProcess("decode", plan)
    try:
        _, prefill_name = connect_pair(prefill, decode)
        s = args.seconds
        rows = [
            ("decode, idle", cpu_share(decode, lambda: time.sleep(s))),
            ("prefill, idle", cpu_share(prefill, lambda: time.sleep(s))),
        ]
        decode.call("expect", "never", 2, 3600.0, prefill_name)

        def waiting() -> None:
            try:
                decode.call("wait", "never", s)
            except HarnessError:
                pass  # the timeout is the point

        rows.append(("decode, waiting on a request", cpu_share(decode, waiting)))
    finally:
        prefill.stop()
        decode.stop()
    print(f"side polls every {IDLE_POLL_S * 1000:.0f} ms while idle; {args.seconds:g} s each")
    print(f"{'state':32} {'share of one core':>18}")
    for name, share in rows:
        print(f"{name:32} {share:>18.3f}")


if __name__ == "__main__":
    main()
