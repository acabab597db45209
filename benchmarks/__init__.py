"""Benchmarks: each measures memserver against a baseline in the same run and prints ratios."""
