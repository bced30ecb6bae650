"""`run-batch --ray`: the job on Ray Data (imported only under `--ray` and by `llmctl.ray_data`).

`cluster`: the connection (`connect`, `import_ray`); `processor`: the two Ray Data stages (the
reading task, and the `Replica` actor, which serves each batch with a `BatchLoop`); `loop`:
`RayLoop`, the driver's loop over the rows replicas return, committing through the single-process
`commits.Committer`; `session`: the pipeline and `RayJobSession`, the driver's `JobSession`, the
only writer.
"""
