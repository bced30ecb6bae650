"""The CPU kernels: C sources in csrc/, compiled on first use with the system C compiler and called
through ctypes on tensors' data pointers, next to the PyTorch paths they replace.

One module per concern:
- `features`: what this CPU executes (/proc/cpuinfo's flags, read once) and its fingerprint;
- `library`: building and loading the C libraries (one table of every library's sources and
  every function's ctypes signature), cached under llmctl's cache folder;
- `linear/`: every linear kernel (`kernels`), the static rule and the per-layer dispatch
  (`dispatch`), and the kernels chosen by measurement (`autotune`);
- `attention`: paged decode attention and the K/V writes; `prefill`: causal prefill attention;
- `elementwise`: RMSNorm (with the residual add), SiLU-and-multiply, RoPE and the greedy argmax.
Everything here is optional: with no compiler or a failed build a library is None (warned once)
and the callers keep the PyTorch reference, which the tests compare against.
"""
