"""Benchmarks: our training and conversion against the tools users would pick instead (see bench/README.md)."""
