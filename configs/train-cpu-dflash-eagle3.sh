#!/usr/bin/env bash
# The CPU training figures of docs/training.md: one producer capturing the union of a 3-layer DFlash
# draft's and an EAGLE-3 draft's layers on SmolLM2-135M-Instruct + ShareGPT (384 tokens, 3000 samples),
# and the two consumers training side by side from it, each evaluated every 100 steps on the plan's last
# 32 samples. About 80 min on a busy 2-core CPU.
#   bash configs/train-cpu-dflash-eagle3.sh [CACHE_DIR] [RUNS_DIR]
set -euo pipefail
cache=${1:-./cache-train}
runs=${2:-./runs}
artcache producer --cache "$cache" --max-length 384 --max-samples 3000 --layer-ids 1,14,26,27,29 \
  --threads 1 --expect-consumers 2 --exit-when-done &
producer=$!
trap 'kill $producer 2>/dev/null || true' EXIT
until [ -f "$cache/artcache.json" ]; do sleep 1; kill -0 $producer || exit 1; done
common=(--cache "$cache" --batch-size 2 --steps 500 --lr 1e-3 --eval-samples 32 --eval-interval 100
        --save-every 100 --window 16:64 --threads 1 --no-progress)
artcache consume "${common[@]}" --draft dflash --id dflash-b16 --draft-layers 3 --block-size 16 --anchors 32 \
  --eval-anchors 64 --out "$runs/dflash-b16" &
d=$!
artcache consume "${common[@]}" --draft eagle3 --id eagle3 --ttt-steps 3 --draft-vocab 4096 --out "$runs/eagle3" &
e=$!
status=0
wait $d || status=1
wait $e || status=1
wait $producer || status=1
exit $status
