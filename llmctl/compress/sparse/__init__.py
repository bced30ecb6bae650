"""Pruning: pure functions that choose which weights of one linear layer become zero.

Owns: sparsity patterns and mask helpers (`masks`), magnitude pruning (`magnitude`), Wanda
(`wanda`), SparseGPT (`sparsegpt`), the per-linear dispatch (`prune`), the whole-model pass on the
shared calibration driver (`pipeline`), the dense HF export (`export`), the `sparsify` job and
its recipes (`job`, `recipe`), and the CUDA 2:4 semi-structured path (`semi_structured`).

Mask convention everywhere in this package: a bool tensor shaped like the weight, True where
the weight is pruned (set to exactly zero).
"""

from llmctl.compress.sparse.masks import SparsityPattern, parse_pattern

__all__ = ["SparsityPattern", "parse_pattern"]
