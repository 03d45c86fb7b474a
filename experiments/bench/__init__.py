"""Benchmarks, run as ``python -m experiments.bench.<name>``: planning time (``make bench``), runtime against
vanilla petals, batching, prefix reuse, soak, and the block load path used by the churn simulations."""
