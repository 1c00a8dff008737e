"""Benchmarks run by a command (``dpcoord bench``), printing ratios against baselines measured in the same run."""
