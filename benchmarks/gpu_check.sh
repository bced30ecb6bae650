#!/usr/bin/env bash
# The one check to run on a fresh NVIDIA GPU machine (written for one H200, 16 cores) that has only
# this repository: environment, CUDA-relevant tests, CUDA smoke runs of the compression commands,
# throughput against transformers `generate` on CUDA, and the 2:4 semi-structured sparse benchmark.
#
#   bash benchmarks/gpu_check.sh                  # everything, within GPU_CHECK_BUDGET_S (default 450 s)
#   GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh  # print the plan and exit
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_TINY=1 GPU_CHECK_SKIP=install bash benchmarks/gpu_check.sh
#                                                 # rehearse on a CPU machine, installing nothing
#
# Every step runs under `timeout`, capped by what is left of the budget, so one hang cannot eat the
# rest; its output is tee'd to "$OUT_DIR/NN-step.log" (OUT_DIR = ${OUT:-/tmp/gpu_check}; models the
# steps write go to ${GPU_CHECK_WORK:-/tmp/gpu_check_work}, so $OUT stays small), and a
# summary of which steps passed goes to the screen and to "$OUT_DIR/summary.txt". Exit status: 0
# when no step failed or timed out, 1 otherwise. Nothing here needs ../shared: the model configs are
# written by this script; steps that would use ../shared material say so and skip when it is absent.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1
OUT_DIR="${OUT:-/tmp/gpu_check}"          # logs and small JSON results only
WORK="${GPU_CHECK_WORK:-/tmp/gpu_check_work}"  # models written by the steps (hundreds of MB), not in OUT_DIR
BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"   # the whole script, pip included; keep it under 8 minutes
DEVICE="${GPU_CHECK_DEVICE:-cuda}"      # cpu only to rehearse the script itself
TINY="${GPU_CHECK_TINY:-0}"             # 1: tiny sizes (rehearsal)
DRY="${GPU_CHECK_DRY:-0}"               # 1: print the plan and exit
SKIP_STEPS=" ${GPU_CHECK_SKIP:-} "      # step names not to run, e.g. GPU_CHECK_SKIP="install throughput"
LIMIT_FACTOR="${GPU_CHECK_LIMIT_FACTOR:-1}"  # integer multiplier of the step limits (slow rehearsal machines)
PY="${PYTHON:-python}"
THREADS="${GPU_CHECK_THREADS:-$(nproc 2>/dev/null || echo 4)}"

mkdir -p "$OUT_DIR" "$OUT_DIR/configs" "$WORK"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"   # works even when `pip install -e .` could not
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1
export LLMCTL_BENCH_CACHE="$WORK/bench-models"
unset TRITON_INTERPRET   # kernels run natively on the GPU unless a step sets it itself

SHARED=""
for d in "$REPO/shared" "$REPO/../shared"; do
    if [ -d "$d" ]; then SHARED="$(cd "$d" && pwd)"; break; fi
done

# --- model configs (published architecture facts; random weights are made from them) -------------
cat > "$OUT_DIR/configs/smollm2-135m.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
 "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
 "max_position_embeddings": 8192, "rope_theta": 100000, "rms_norm_eps": 1e-05, "hidden_act": "silu",
 "tie_word_embeddings": true, "attention_bias": false, "mlp_bias": false, "bos_token_id": 0, "eos_token_id": 0,
 "torch_dtype": "bfloat16"}
EOF
cat > "$OUT_DIR/configs/qwen2.5-0.5b.json" <<'EOF'
{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
 "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
 "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu",
 "tie_word_embeddings": true, "use_sliding_window": false, "bos_token_id": 151643, "eos_token_id": 151643,
 "torch_dtype": "bfloat16"}
EOF
cat > "$OUT_DIR/configs/tiny-llama.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
 "max_position_embeddings": 2048, "rope_theta": 10000, "rms_norm_eps": 1e-05, "hidden_act": "silu",
 "tie_word_embeddings": false, "attention_bias": false, "mlp_bias": false, "bos_token_id": 1, "eos_token_id": 2,
 "torch_dtype": "bfloat16"}
EOF

if [ "$TINY" = 1 ]; then
    BENCH_ARGS=(--config "$OUT_DIR/configs/tiny-llama.json" --num-prompts 8 --prefix-prompts 4 --hf-batch-size 4)
    SPARSE_ARGS=(--shapes 256x256 --tokens 1,16 --iters 5 --model-config "$OUT_DIR/configs/tiny-llama.json" --batch-seq 1x16)
    GRAPH_ARGS=(--config "$OUT_DIR/configs/tiny-llama.json" --batches 1,4 --output-len 16)
else
    BENCH_ARGS=(--config "$OUT_DIR/configs/smollm2-135m.json" --num-prompts 256 --prefix-prompts 64 --hf-batch-size 32)
    SPARSE_ARGS=(--iters 20 --model-config "$OUT_DIR/configs/qwen2.5-0.5b.json" --batch-seq 1x128,8x512)
    GRAPH_ARGS=(--config "$OUT_DIR/configs/smollm2-135m.json" --batches 1,8,64 --output-len 128)
fi

# --- the steps ------------------------------------------------------------------------------------

step_env() {
    echo "date: $(date -u +%FT%TZ)  host: $(hostname)  repo: $REPO  commit: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "shared material: ${SHARED:-none (steps that would use it skip)}"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
    else
        echo "nvidia-smi: not found"
    fi
    "$PY" - "$DEVICE" <<'EOF'
import platform, sys
print("python", sys.version.split()[0], platform.platform())
import torch
print("torch", torch.__version__, "cuda build", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("cuda available:", torch.cuda.is_available(), "devices:", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} capability {p.major}.{p.minor} memory {p.total_memory / 2**30:.1f} GiB SMs {p.multi_processor_count}")
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton: not importable:", e)
for mod in ("transformers", "safetensors", "pyarrow", "typer", "compressed_tensors", "pytest"):
    try:
        print(mod, __import__(mod).__version__)
    except Exception as e:  # noqa: BLE001
        print(mod, "missing:", type(e).__name__, e)
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit("FAIL: this check is for a CUDA machine and torch sees no GPU")
EOF
}

step_install() {
    # Pin the torch (and triton) already installed, so pip never swaps in a multi-GB build; without
    # an index pip fails fast and the rest runs from PYTHONPATH with whatever is installed.
    local pins="$OUT_DIR/pip-constraints.txt"
    "$PY" - > "$pins" <<'EOF'
from importlib.metadata import version, PackageNotFoundError
for name in ("torch", "triton"):
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
EOF
    echo "constraints: $(tr '\n' ' ' < "$pins")"
    # With setuptools and wheel already installed, build them here (no index needed for the build).
    local iso=()
    if "$PY" -c "import setuptools, wheel" 2>/dev/null; then iso=(--no-build-isolation); fi
    "$PY" -m pip install -q --retries 1 --timeout 15 "${iso[@]}" -c "$pins" -e ".[test]"
    local rc=$?
    if [ $rc -ne 0 ]; then
        echo "pip install -e .[test] failed (rc $rc); trying the package alone (--no-deps), then PYTHONPATH=$REPO"
        "$PY" -m pip install -q --no-deps --no-build-isolation -e . || echo "pip install --no-deps -e . failed too"
    fi
    "$PY" -c "import llmctl, torch, transformers, typer, rich, safetensors, pyarrow, yaml, pytest; print('imports ok, llmctl', llmctl.__version__, 'from', llmctl.__file__)"
}

step_triton_test() {
    # tests/test_triton_kernels.py always runs the kernels in a subprocess with TRITON_INTERPRET=1 on
    # CPU tensors (it compares them with the PyTorch references); it has no native/GPU mode. It is run
    # as is; the next step runs the same script natively on the GPU.
    "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py
}

step_triton_native() {
    # The test's SCRIPT, with every tensor created on the GPU and no interpreter: the compiled kernels
    # against the PyTorch references on CUDA (max abs error < 1e-5 in float32).
    "$PY" - "$DEVICE" <<'EOF'
import ast, os, sys, textwrap
import torch
if sys.argv[1] != "cuda" or not torch.cuda.is_available():
    print("SKIP: no CUDA device; the Triton kernels only run natively on a GPU")
    sys.exit(0)
assert "TRITON_INTERPRET" not in os.environ
tree = ast.parse(open("tests/test_triton_kernels.py").read())
script = next(textwrap.dedent(n.value.args[0].value) for n in tree.body
              if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "SCRIPT")
torch.set_default_device("cuda")
assert torch.randn(1).is_cuda
exec(compile(script, "tests/test_triton_kernels.py:SCRIPT", "exec"), {})
torch.cuda.synchronize()
print("native Triton kernels on", torch.cuda.get_device_name(), "match the references")
EOF
}

step_exactness_file() {
    # tests/test_engine_exactness.py has no device parameter: it pins device="cpu" (only the test that
    # needs ../shared/models/tinyshakespeare-5m uses the default device, cuda here). Run as is; the
    # next step does the same comparison on CUDA.
    "$PY" -m pytest -q -p no:cacheprovider tests/test_engine_exactness.py
}

step_exactness_cuda() {
    "$PY" - "$DEVICE" "$WORK/exactness-models" "$SHARED" <<'EOF'
import sys
from pathlib import Path
import torch
device, root, shared = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
if device == "cuda" and not torch.cuda.is_available():
    sys.exit("FAIL: no CUDA device")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
from transformers import AutoModelForCausalLM
from llmctl import LLM, SamplingParams
from llmctl.kernels.attention import _triton_kernels
from tests.conftest import make_random_model
from tests.test_engine_exactness import MAX_NEW, random_prompts

print("paged attention path on", device, ":", "Triton kernels" if _triton_kernels(torch.empty(1, device=device)) else "PyTorch reference")

def hf_greedy(path, prompts, max_new):
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    hf.generation_config.eos_token_id = None
    outs = []
    for p in prompts:  # one at a time: no padding in the reference
        ids = torch.tensor([p], device=device)
        with torch.inference_mode():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    return outs

cases = []
for arch in ("llama", "mistral", "qwen2", "qwen3"):
    folder = root / arch
    if not (folder / "model.safetensors").exists():
        make_random_model(folder, arch, seed=2)
    cases.append((arch, folder, random_prompts(160), {}))
cases.append(("llama block-size-1", root / "llama", random_prompts(160), {"block_size": 1}))
cases.append(("llama no-prefix-caching", root / "llama", random_prompts(160), {"enable_prefix_caching": False}))
cases.append(("llama tiny-token-budget", root / "llama", random_prompts(160), {"max_num_batched_tokens": 7}))
# K and V, 2 layers, 2 KV heads of 16 dims, 4 bytes, blocks of 4 tokens: 18 blocks force preemption
cases.append(("llama tiny-kv-budget", root / "llama", random_prompts(160), {"block_size": 4, "kv_cache_memory": 18 * 4 * 2 * 2 * 2 * 16 * 4}))
stories = Path(shared) / "models" / "stories260k" if shared else None
if stories is not None and stories.exists():
    cases.append(("stories260k", stories, [[1] + p for p in random_prompts(512, seed=3)], {}))
else:
    print("skip stories260k case: needs shared/models/stories260k (not present)")

failed = 0
for name, folder, prompts, kw in cases:
    kw = {"kv_cache_memory": 8 * 1024**2, **kw}
    llm = LLM(str(folder), dtype="float32", device=device, **kw)
    ours = [o.output_token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))]
    ref = hf_greedy(folder, prompts, MAX_NEW)
    bad = [i for i, (a, b) in enumerate(zip(ours, ref)) if a != b]
    extra = f", preemptions {llm.engine.scheduler.num_preemptions}" if "kv" in name else ""
    print(f"{name:28s} {'ok' if not bad else 'MISMATCH in prompts ' + str(bad)} ({len(prompts)} prompts x {MAX_NEW} tokens{extra})")
    for i in bad[:2]:
        print("   ours", ours[i], "\n   hf  ", ref[i])
    failed += bool(bad)
sys.exit(1 if failed else 0)
EOF
}

step_quant_triton_tests() {
    # The Triton dequantize-GEMM: the test runs it under TRITON_INTERPRET=1 on the CPU and, when torch
    # sees CUDA, natively on the GPU (float32, float16, bfloat16), plus QuantLinear's routing.
    if [ -f tests/test_triton_quant.py ]; then
        "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_quant.py
    else
        echo "SKIP: no tests/test_triton_quant.py in this checkout (no quantized Triton kernels yet)"
    fi
}

step_compress_smoke() {
    # quantize (GPTQ, AWQ), sparsify (SparseGPT 2:4) and eval on $DEVICE with the embedded demo model,
    # then run-batch loads each result back (quantized ones as packed QuantLinear layers) on $DEVICE;
    # on CUDA their decode steps go through the Triton dequantize-GEMM.
    local demo="llmctl/data/demo-model" calib="llmctl/compress/data/calib_default.txt" w="$WORK/compress" r="$OUT_DIR/compress"
    mkdir -p "$r"
    local cli=("$PY" -m llmctl.cli)
    set -e
    "${cli[@]}" quantize "$demo" -o "$w/gptq" --gptq --group-size 64 --calib "$calib" --num-samples 8 --seq-len 128 --device "$DEVICE" --overwrite --quiet --report-json "$r/gptq.json"
    "${cli[@]}" quantize "$demo" -o "$w/awq" --awq --format awq --group-size 64 --calib "$calib" --num-samples 8 --seq-len 128 --device "$DEVICE" --overwrite --quiet --report-json "$r/awq.json"
    "${cli[@]}" sparsify "$demo" -o "$w/2of4" --pattern 2:4 --calib "$calib" --num-samples 8 --seq-len 128 --device "$DEVICE" --overwrite --quiet --report-json "$r/2of4.json"
    "$PY" - "$r" <<'EOF'
import json, sys
for name in ("gptq", "awq", "2of4"):
    r = json.load(open(f"{sys.argv[1]}/{name}.json"))
    r = r.get("sparsify", r)
    print(f"{name}: perplexity {r.get('perplexity_before')} -> {r.get('perplexity_after')}")
EOF
    for m in gptq awq 2of4; do
        "${cli[@]}" run-batch examples/prompts.jsonl -m "$w/$m" -o "$r/$m-out.jsonl" --max-tokens 16 --device "$DEVICE" --overwrite --quiet --report-json "$r/$m-summary.json"
        echo "run-batch $m: $(head -c 200 "$r/$m-out.jsonl" | head -1)"
    done
    "${cli[@]}" eval "$w/gptq" --data "$calib" --seq-len 128 --reference "$demo" --device "$DEVICE" --report-json - --quiet
    set +e
}

step_cuda_graphs() {
    # Decode steps replayed as captured CUDA graphs: the test compares their tokens with eager steps
    # (it runs on CUDA here; on CPUs only its static-buffer half runs), then the benchmark times
    # decode with graphs against --enforce-eager at batch 1, 8 and 64.
    "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py || return 1
    "$PY" benchmarks/bench_cuda_graphs.py "${GRAPH_ARGS[@]}" --json "$OUT_DIR/cuda-graphs.json"
}

step_batch_invariant() {
    # Batch invariance on CUDA (issue 20): the property test of tests/test_batch_invariance.py run on
    # the GPU (the Triton kernels of kernels/cuda/invariant.py, decode CUDA graphs on), then the
    # throughput cost of --batch-invariant on the demo model (output tokens/s, default vs invariant).
    LLMCTL_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider \
        tests/test_batch_invariance.py -k "every_row or quantized" || return 1
    "$PY" benchmarks/bench_batch_invariant.py --device "$DEVICE" --reps 2 --threads "$THREADS" \
        --json "$OUT_DIR/batch-invariant.json"
}

step_throughput() {
    # llmctl's engine against transformers `generate` (static padded batches), both on $DEVICE, bf16,
    # random weights of SmolLM2-135M's shape; prints JSON and writes $OUT_DIR/throughput.json.
    "$PY" benchmarks/bench_throughput.py "${BENCH_ARGS[@]}" --device "$DEVICE" --threads "$THREADS" --json "$OUT_DIR/throughput.json"
}

step_sparse_2of4() {
    # Dense against 2:4 semi-structured matmuls (real model shapes), then a whole random Qwen2.5-0.5B
    # forward pass; the entry point prints {"skipped": why} off CUDA or below compute capability 8.0.
    local res="$OUT_DIR/sparse-2of4.jsonl"
    "$PY" benchmarks/bench_semi_structured.py "${SPARSE_ARGS[@]}" | tee "$res"
    local rc=${PIPESTATUS[0]}
    if grep -q '"skipped"' "$res"; then echo "SKIP: $(head -1 "$res")"; fi
    return "$rc"
}

#        name                 most seconds  function
STEPS=(  "env                 60            step_env"
         "install             150           step_install"
         "triton-native       90            step_triton_native"
         "exactness-cuda      120           step_exactness_cuda"
         "cuda-graphs         90            step_cuda_graphs"
         "batch-invariant     150           step_batch_invariant"
         "throughput          200           step_throughput"
         "sparse-2of4         120           step_sparse_2of4"
         "compress-smoke      150           step_compress_smoke"
         "quant-triton-tests  60            step_quant_triton_tests"
         "triton-test-file    90            step_triton_test"
         "exactness-test-file 150           step_exactness_file" )

# `bash gpu_check.sh --step FUNCTION` runs one step (the loop below runs each so, under `timeout`).
if [ "${1:-}" = "--step" ]; then
    "$2"
    exit $?
fi

echo "gpu_check: device $DEVICE, budget ${BUDGET_S}s, output in $OUT_DIR, tiny=$TINY"
echo "plan (each step capped by its own limit and by what is left of the budget):"
for s in "${STEPS[@]}"; do
    read -r name limit fn <<<"$s"
    [[ "$SKIP_STEPS" == *" $name "* ]] && note="(skipped: GPU_CHECK_SKIP)" || note=""
    printf '  %-20s <= %4ss  %s %s\n' "$name" "$limit" "$fn" "$note"
done
if [ "$DRY" = 1 ]; then
    echo "GPU_CHECK_DRY=1: not running anything"
    exit 0
fi

SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
RESERVE_S=5
n=0
failures=0
for s in "${STEPS[@]}"; do
    read -r name limit fn <<<"$s"
    n=$((n + 1))
    log="$(printf '%s/%02d-%s.log' "$OUT_DIR" "$n" "$name")"
    if [[ "$SKIP_STEPS" == *" $name "* ]]; then
        printf '%-20s %-40s\n' "$name" "SKIP (GPU_CHECK_SKIP)" >> "$SUMMARY"
        continue
    fi
    left=$((BUDGET_S - SECONDS - RESERVE_S))
    if [ "$left" -lt 15 ]; then
        printf '%-20s %-40s\n' "$name" "SKIP (budget spent)" | tee -a "$SUMMARY"
        continue
    fi
    limit=$((limit * LIMIT_FACTOR))
    t=$(( limit < left ? limit : left ))
    echo
    echo "=== [$n/${#STEPS[@]}] $name (timeout ${t}s, ${SECONDS}s elapsed) -> $log"
    start=$SECONDS
    timeout --signal=TERM --kill-after=10 "$t" bash "${BASH_SOURCE[0]}" --step "$fn" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    dt=$((SECONDS - start))
    if [ $rc -eq 0 ]; then
        if grep -q '^SKIP: ' "$log"; then status="SKIP ($(grep -m1 '^SKIP: ' "$log" | cut -c7- | cut -c1-32))"; else status="PASS"; fi
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        status="TIMEOUT after ${t}s"; failures=$((failures + 1))
    else
        status="FAIL (rc $rc)"; failures=$((failures + 1))
    fi
    printf '%-20s %-40s %4ss  %s\n' "$name" "$status" "$dt" "$log" >> "$SUMMARY"
done

echo
echo "=== summary (${SECONDS}s total, device $DEVICE) -> $SUMMARY"
cat "$SUMMARY"
[ -f "$OUT_DIR/throughput.json" ] && "$PY" - "$OUT_DIR/throughput.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
line = f"throughput: llmctl {r['llmctl']['output_tok_s']:.0f} output tok/s"
if "transformers" in r:
    line += f", transformers {r['transformers']['output_tok_s']:.0f} tok/s, speedup {r['speedup_vs_transformers']:.2f}x"
if "shared_prefix_prefill" in r:
    line += f"; shared-prefix prefill speedup {r['shared_prefix_prefill']['speedup']:.2f}x"
print(line)
EOF
[ -f "$OUT_DIR/cuda-graphs.json" ] && "$PY" - "$OUT_DIR/cuda-graphs.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print("cuda graphs: " + ", ".join(f"batch {x['batch']} {x['speedup']:.2f}x ({x['eager_decode_tok_s']:.0f} -> "
                                  f"{x['graph_decode_tok_s']:.0f} decode tok/s, same tokens: {x['same_tokens']})"
                                  for x in r["rows"]))
EOF
[ "$failures" -eq 0 ]
