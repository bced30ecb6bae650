"""run-batch below the command line: inputs, the driver loop, outputs, resume state and totals.

`runner.run_batch` is the entry point; `job.BatchJob` is the engine-agnostic loop.
"""
