#!/usr/bin/env bash
# Greedy run-batch outputs of two commits, byte for byte: the demo model and the tinyshakespeare
# fixture (../shared), float32 and bfloat16, plain, --batch-invariant and --speculative ngram, the
# static kernel rules (--no-autotune: timed choices may differ between runs in the last bits).
#   bash benchmarks/check_same_outputs.sh BASE HEAD      (prints SAME/DIFF per run; exit 1 on DIFF)
set -euo pipefail
BASE=${1:?base commit}; HEAD=${2:-HEAD}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python - > "$WORK/sh_prompts.jsonl" <<'P'
import json
lines = ["ROMEO:", "First Citizen:\nWe are", "KING HENRY:\nWhat say", "To be, or not",
         "JULIET:\nO Romeo", "The quality of mercy", "Now is the winter", "MENENIUS:\nI tell you"]
for i, line in enumerate(lines * 3):
    print(json.dumps({"prompt": line + " " * (i % 3), "max_tokens": 24 + i}))
P
run_all() {  # TREE OUT
    mkdir -p "$2"
    for model in demo sh; do
        if [ $model = demo ]; then inp=$1/examples/prompts.jsonl; m=(); else
            inp=$WORK/sh_prompts.jsonl; m=(--model "$REPO/../shared/models/tinyshakespeare-5m"); fi
        for dtype in float32 bfloat16; do
            for mode in plain inv ngram; do
                extra=(); [ $mode = inv ] && extra=(--batch-invariant)
                [ $mode = ngram ] && extra=(--speculative ngram)
                (cd "$1" && PYTHONPATH="$1" LLMCTL_CACHE_DIR="$2/cache" python -c \
                    "import sys; from llmctl.cli import main; sys.exit(main(sys.argv[1:]))" \
                    run-batch "$inp" -o "$2/$model-$dtype-$mode.jsonl" "${m[@]}" --dtype $dtype \
                    "${extra[@]}" -q --max-tokens 32 --include-token-ids --no-autotune)
            done
        done
    done
}
for side in base head; do
    rev=$BASE; [ $side = head ] && rev=$HEAD
    mkdir "$WORK/$side"; git -C "$REPO" archive "$rev" | tar -x -C "$WORK/$side"
    run_all "$WORK/$side" "$WORK/out-$side"
done
status=0
for f in "$WORK"/out-base/*.jsonl; do
    name=$(basename "$f")
    if cmp -s "$f" "$WORK/out-head/$name"; then echo "SAME $name"; else echo "DIFF $name"; status=1; fi
done
exit $status
