"""Profiling and evaluation: estimates from a config, machine peaks, measured sweeps, perplexity.

Modules: `estimate` (math on a ModelConfig), `arch_counts` (what `estimate` counts for families
beyond the Llama layout, from transformers' meta-device model), `config_source` (finding a
config.json), `environment` (who/where a record was measured),
`machine` (measured bandwidth and matmul peak, cached), `sweep` (the measured sweep through the
engine), `report` (JSON/CSV/Markdown/PNG writers), `compare` (regression check between two sweep
files), `dtypes` (one spelling of float dtypes), and the commands' jobs: `sweep_job`,
`estimate_job`, `eval_job` (options with their defaults in, records out), `tables` (table cells).
Nothing here imports typer or rich.
"""
