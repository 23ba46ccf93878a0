#!/usr/bin/env bash
# DFlash on target-regenerated data (docs/training.md, "DFlash on target-regenerated answers (CPU)"): SmolLM2-135M-Instruct
# answers the first 640 usable ShareGPT prompts of <= 160 tokens itself (greedy, <= 224 new tokens, so every
# sample fits in 384 tokens), one producer captures DFlash's 3 layers [1, 14, 27] plus the last layer 29 (for
# the greedy replay against the target's argmax), and one DFlash consumer trains 300 steps x 2 samples with the
# same settings as configs/train-cpu-dflash-eagle3.sh, evaluated every 100 steps on the plan's last 32 samples.
# About 35 min of generation and 25 min of training on a 2-core CPU.
#   bash configs/train-cpu-dflash-regenerated.sh [WORK_DIR]
set -euo pipefail
work=${1:-./regen-dflash}
mkdir -p "$work"
data="$work/sharegpt-smollm2-640.jsonl"
cache="$work/cache"
[ -f "$data" ] || artcache regenerate --out "$data" --max-samples 640 --max-new-tokens 224 \
  --max-prompt-tokens 160 --batch-size 32 --no-progress
artcache producer --cache "$cache" --data "$data" --max-length 384 --max-samples 640 --layer-ids 1,14,27,29 \
  --threads 1 --expect-consumers 1 --exit-when-done &
producer=$!
trap 'kill $producer 2>/dev/null || true' EXIT
until [ -f "$cache/artcache.json" ]; do sleep 1; kill -0 $producer || exit 1; done
artcache consume --cache "$cache" --draft dflash --id dflash-regen --draft-layers 3 --block-size 16 --anchors 32 \
  --eval-anchors 64 --batch-size 2 --steps 300 --lr 1e-3 --eval-samples 32 --eval-interval 100 --save-every 100 \
  --window 16:64 --threads 1 --no-progress --out "$work/runs/dflash-regen"
wait $producer
