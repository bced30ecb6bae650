"""Pruning: pure functions that choose which weights of one linear layer become zero.

Owns: sparsity patterns and mask helpers (`masks`), magnitude pruning (`magnitude`), Wanda
(`wanda`), SparseGPT (`sparsegpt`), the per-linear dispatch (`prune`), the whole-model pass on the
shared calibration driver (`model`: which linears, the sparsify settings), the prune step of the
one-shot pipeline (`step`), the dense HF export (`export`) and the `sparsify` job (`job`, with the
recipe.yaml it writes). Reading and running recipes is llmctl.recipes.

Mask convention everywhere in this package: a bool tensor shaped like the weight, True where
the weight is pruned (set to exactly zero).
"""

from llmctl.compress.sparse.masks import SparsityPattern, parse_pattern

__all__ = ["SparsityPattern", "parse_pattern"]
