"""The output folder of distill: an ordinary Hugging Face model folder.

Owns: `write_student`: config.json (the student's, float32), model.safetensors (or shards above
--max-shard-size), the teacher's tokenizer and generation files, `distill.yaml` (the resolved
recipe) and `distill_report.json`, written into OUT/.llmctl-work/result and moved into place
by OutputFolder.commit().
"""

from __future__ import annotations

import json
from pathlib import Path

from llmctl.runtime.output_dir import OutputFolder, copy_side_files, output_config, writing
from llmctl.train.args import DistillArgs

RECIPE = "distill.yaml"
REPORT = "distill_report.json"
HEADER = "# llmctl distill: resolved arguments of the run that wrote this folder\n"


def student_tensors(student) -> dict:
    """The student's parameters by checkpoint name (a transformers student's fused experts split
    again, as transformers saves them), tied ones once, contiguous on the CPU."""
    from llmctl.models.linears import export_state
    from llmctl.train.checkpoint import unique_tensors

    return unique_tensors(
        {k: v.detach().cpu().contiguous() for k, v in export_state(student).items()}
    )


def write_student(
    out: OutputFolder, teacher_path: Path, student, raw: dict, args: DistillArgs, report: dict
) -> None:
    import yaml

    from llmctl.runtime.shards import save_sharded

    with writing(f"-o {out.final}"):
        result = out.fresh_result()
        dtype_key = "torch_dtype" if "torch_dtype" in raw else "dtype"
        config = output_config(raw, {dtype_key: "float32"})
        save_sharded(student_tensors(student), result, args.max_shard_size)
        copy_side_files(teacher_path, result)
        (result / RECIPE).write_text(
            HEADER + yaml.safe_dump({"distill": args.to_recipe()}, sort_keys=False)
        )
        (result / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        (result / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        out.commit()
