"""Experiments beside the recipes: single-process baselines the benchmarks compare runs against."""
