"""Benchmarks: `python -m bench.bench_rollout` (results in reports/bench.json)."""
