"""Harnesses for tests, the demo and benchmarks (not part of an engine's road).

``kvarena.testing.loopback`` runs a prefill and a decode side in two local
processes and drives them over pipes; the data path is NIXL's.
"""
