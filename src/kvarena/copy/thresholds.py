"""The measured thresholds that route a batch of copies, in one place.

Each number is where one strategy overtook another on a 2-core CPU with
torch 2.13 (``benchmarks/bench_checkpoint.py``, ``benchmarks/bench_spans.py``);
the docstring under each says what was measured.
"""

LARGE_SPAN_BYTES = 128 * 1024
"""Spans at least this long leave the grouped short-span road: they move as a
gather or strided family (of MIN_RUN or more), else one copy each. In a batch
split over threads, spans in no family leave it sooner (THREADED_SPAN_BYTES).

Measured with ``benchmarks/bench_spans.py --mib 1`` on the 2-core CI machine
class (torch 2.13, spans at uneven destinations, so no family takes them; a
batch that small runs on one thread, where a span of its own is a torch
call): grouping moves 1.2-5x the bytes per second of one call per span below
64 KiB (4 KiB: 0.08-0.10x memcpy vs 0.02x; 32 KiB: 0.09-0.10x vs
0.07-0.08x), and the two tie from 64 KiB on."""

THREADED_SPAN_BYTES = 8 * 1024
"""In a batch split over threads, spans in no family move one memcpy each from
this length (grouped by length below it).

Measured with ``benchmarks/bench_spans.py`` on the 2-core CI machine class
(torch 2.13, 512 MiB of spans at uneven destinations, so no gather or strided
family takes them, paired rounds): one numpy memcpy each on two threads
0.23-0.24x memcpy at 8 KiB against 0.20x grouped, 0.49-0.51x against
0.29-0.30x at 16 KiB, 0.79-0.83x against 0.39-0.47x at 256 KiB; at 4 KiB the
two tie (0.13-0.14x). A batch on one thread (below PARALLEL_MIN_BYTES) keeps
LARGE_SPAN_BYTES: there each span would be a torch call, and grouping won
(1 MiB of 8-64 KiB spans: 0.09x against 0.04-0.09x)."""

TORCH_SPAN_BYTES = 1 << 20
"""Spans at least this long that no family takes are each one torch ``copy_``
on torch's own threads.

Measured on the 2-core CI machine class (torch 2.13, paired rounds, spans
scattered on the destination): 64 spans of 4.7 MB, one ``copy_`` each 0.82x
memcpy vs one numpy memcpy each on two Python threads 0.67x; 256 of 1 MiB
0.82x vs 0.72x; from 256 KiB down the two tie (0.72x vs 0.74x), and below
that the thread hand-off of each ``copy_`` costs more than it splits."""

STAGING_BYTES = 1 << 20
"""Short spans move through staging chunks of about this many bytes (cache-sized)."""

MIN_RUN = 4
"""Short spans adjacent on one side move in one pass once this many form a run."""

PROGRESSION_MIN_BYTES = 256 * 1024
"""A strided family of spans moves as one ``copy_`` from this many bytes up.

Measured on the 2-core CI machine class (torch 2.13): a ``copy_`` call costs
5-10 us of setup and thread hand-off, the time 75-150 KiB take to copy, so
from 256 KiB the call runs above 90% of its streaming speed. 804 blocks of
192 KiB, every other one relocated: one strided ``copy_`` 14.2-14.8 GB/s,
one call per span 10-12 GB/s, a plain memcpy of the bytes 14.7-15.9 GB/s."""

PARALLEL_MIN_BYTES = 4 << 20
"""CPU batches of at least this many bytes are split over torch's threads.

Measured on the 2-core CI machine (``benchmarks/bench_checkpoint.py``,
``bench_boundary.py``): starting a thread costs tens of microseconds, about
the time one core copies 0.5 MiB; at 4 MiB the second core's share pays for
it several times over, below it the gain is lost in noise."""
