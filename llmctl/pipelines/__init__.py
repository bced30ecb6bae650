"""Multi-stage recipes: `llmctl recipe run|validate` below the CLI.

Owns the orchestration of several jobs in one run (sparsify, quantize, distill, eval, run-batch,
in that order), which is why it sits above the four peers (compress, train, profiling, batch) and
may import each of them; only `llmctl.commands` imports this package, and nothing here imports
typer or rich. Modules: `schema` (the recipe format, validated with pydantic), `llmcompressor`
(llm-compressor's recipe syntax translated to ours), `paths` (where a recipe's files are),
`stages` (one job per stage, through the same functions the commands call) and `recipe_job`
(validation of every stage, the resolved recipe, resume at the first unfinished stage).
"""
