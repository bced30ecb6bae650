"""Recipes: every YAML file that tells llmctl which compression jobs to run, read and run here.

Owns both recipe forms and their runs, which is why it sits above the four peers (compress,
train, profiling, batch) and may import each of them; only `llmctl.commands` imports this
package, and nothing here imports typer or rich.

- The multi-stage recipe, `llmctl recipe run|validate` (sparsify, quantize, distill, eval,
  run-batch, in that order): `schema` (the format, validated with pydantic), `llmcompressor`
  (llm-compressor's recipe syntax translated to ours), `paths` (reading the file, where its
  files are, command-line values), `stages` (one job per stage, through the same functions the
  commands call) and `recipe_job` (validation of every stage, the resolved recipe, resume at the
  first unfinished stage).
- The single-run recipe, `llmctl sparsify --recipe` (prune, then optionally quantize):
  `sparsify_recipe` (reading it) and `sparsify_run` (running it through the one-shot pipeline,
  llmctl.compress.oneshot); `recipe run` reads the same file as two stages.
- `sections`: the calibration, sparsify and quantize sections both forms share.

The `recipes/` folder at the repository root holds example recipe files (data, not this package).
"""
