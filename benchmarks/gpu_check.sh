#!/usr/bin/env bash
# The checks a CUDA machine runs, in one go: the CUDA tests, then the GPU rows
# of the copy benchmarks (one Triton launch per batch vs the per-layer loop vs
# one large copy_ of the same bytes), the vLLM connector's copies per layout
# where vLLM is installed, then the CPU checkpoint rows on that machine's cores. Each part's output is kept in $OUT (or /tmp/kvarena-gpu) as
# it is printed, so a run stopped by a time limit keeps what it finished.
#
#     bash benchmarks/gpu_check.sh            # from the repository root
#
# Needs a python3 with a CUDA build of torch, numpy, typer, rich, xxhash,
# pytest and hypothesis (Triton is used when it imports); kvarena is read from
# src/, nothing is installed. Exits 2 when no CUDA device is visible.
set -uo pipefail

out=${OUT:-/tmp/kvarena-gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $py; nothing to check" >&2
    exit 2
fi
"$py" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$out/device.txt"
"$py" -c "import triton; print('triton', triton.__version__)" 2>/dev/null | tee -a "$out/device.txt"

status=0
"$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/test_gpu.txt" || status=1

"$py" benchmarks/bench_entry_copy.py --device cuda --requests 64 --repeats 20 2>&1 |
    tee "$out/bench_entry_copy_cuda.txt" || status=1
"$py" benchmarks/bench_checkpoint.py --device cuda --requests 64 --repeats 20 \
    --placement allocated shuffled 2>&1 | tee "$out/bench_checkpoint_cuda.txt" || status=1

# Where vLLM is installed (vllm==0.32.*): the connector's copies of a request in
# vLLM's layer-major and block-major layouts, on the device (vLLM's own allocation).
if "$py" -c "import vllm" 2>/dev/null; then
    # the saves' gather on a side stream into pinned memory, checked by bytes
    "$py" -m pytest -q -p no:cacheprovider tests/test_vllm_layouts.py -k cuda 2>&1 |
        tee "$out/test_vllm_layouts_cuda.txt" || status=1
    "$py" benchmarks/bench_vllm_layout.py --device cuda 2>&1 |
        tee "$out/bench_vllm_layout_cuda.txt" || status=1
fi

# Last, as it is the longest and needs no GPU: the CPU rows on a many-core host.
"$py" benchmarks/bench_checkpoint.py --device cpu --requests 64 --repeats 5 \
    --unit-kib 16 2>&1 | tee "$out/bench_checkpoint_cpu.txt" || status=1
exit $status
