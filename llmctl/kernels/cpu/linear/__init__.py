"""Every CPU linear kernel and the choice between them.

- `c_kernels`: the C kernels (csrc/cpu_linear.c, the float32/bf16 register-tile kernel;
  cpu_linear_dpbf16.c, AVX512-BF16 `vdpbf16ps`; cpu_linear_amx.c, AMX tiles over a packed copy)
  and `SOURCES`, every C file and header they are compiled from;
- `torch_kernels`: the PyTorch ones (bf16 widened to float32 slabs for the float32 BLAS; oneDNN's
  packed weights);
- `dispatch`: the candidates by name, the static rule, and `linear`, the one call a layer makes;
- `autotune`: the kernel per row count chosen by measurement at engine start (`Plan`), cached.
"""
