"""Profiling: memory/throughput estimates from a config, machine peaks, measured sweeps and their reports.

Modules: `estimate` (pure math on a ModelConfig), `environment` (who/where a record was measured),
`machine` (measured bandwidth and matmul peak, cached), `sweep` (the measured sweep through the engine),
`report` (JSON/CSV/Markdown/PNG writers), `compare` (regression check between two sweep files).
Nothing here imports typer or rich.
"""
