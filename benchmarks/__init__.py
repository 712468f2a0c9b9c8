"""Benchmarks for the ``megatron-core`` state-adoption build (GPU only)."""
