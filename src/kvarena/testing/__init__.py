"""Harnesses for tests and benchmarks (the library never imports them).

``kvarena.testing.redis_server`` starts a real ``redis-server`` on a free
localhost port for a test or a benchmark.
"""
