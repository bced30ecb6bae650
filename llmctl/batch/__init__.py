"""run-batch below the command line: inputs, the loop, outputs, resume state and totals.

One name per role: `runner.run_batch` is the command's entry (one invocation end to end);
`session.JobSession` is one session of a job (resume state, commits, failures); `loop.BatchLoop`
is the engine-agnostic loop, writing through `commits.Committer`; `backends.load_engine` loads
the runtime and engine. `ray/` holds `--ray` (its `RayJobSession` and `RayLoop` reuse the above).
"""
