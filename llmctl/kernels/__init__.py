"""The kernels below the models: every way a layer's arithmetic can run, and the choice of one.

- `config`: `KernelConfig`, every kernel choice of an engine, passed down from where it is set;
- `attention`: paged attention's dispatcher, its metadata and the PyTorch references;
- `invariant`: the batch-invariant (fixed reduction order) linear, MLP and RMSNorm paths;
- `cpu/`: the C kernels and CPU linear kernels (features, library, linear/, attention, prefill,
  elementwise);
- `cuda/`: the Triton kernels (attention, invariant, quant), imported only where triton is.
"""
