#!/usr/bin/env bash
# One producer and three DFlash consumers (block sizes 4, 8, 16) on SmolLM2-135M-Instruct + ShareGPT,
# started by hand instead of through `artcache bench`. Copy and edit.
#   bash configs/smollm2-cpu-1p3c.sh [CACHE_DIR] [STEPS]
set -euo pipefail
cache=${1:-./cache-smollm2}
steps=${2:-200}
artcache producer --cache "$cache" --max-length 512 --max-samples 2000 --draft-layers 5 \
  --exit-when-done --threads 1 &
producer=$!
trap 'kill $producer 2>/dev/null || true' EXIT
until [ -f "$cache/artcache.json" ]; do sleep 1; kill -0 $producer || exit 1; done
pids=()
for b in 4 8 16; do
  artcache consume --cache "$cache" --draft dflash --window 64:256 --block-size $b --anchors 32 \
    --batch-size 2 --steps "$steps" --threads 1 --id "dflash-b$b" --out "runs/dflash-b$b" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
wait $producer || status=1
artcache inspect --cache "$cache"
exit $status
