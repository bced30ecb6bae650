"""Training: `llmctl distill` (knowledge distillation of a teacher into a smaller student).

Owns: `args` (DistillArgs, the defaults and the checks that need no model), `losses` (the
distillation losses as pure functions on logits), `data` (streamed, packed training sequences with
loss masks), `student` (building the student and checking its tokenizer), `checkpoint` (resumable
state as safetensors + JSON), `distributed` (DDP from torchrun's environment), `onpolicy` (the
student's own samples through the engine), `teacher_cache` (the teacher's top-k logits on disk),
`loop` (the optimisation loop) and `job` (the whole run, from checks to the output folder).
"""
