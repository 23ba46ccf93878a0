#!/usr/bin/env bash
# One resumable piece of DSpark training on the real SmolLM2 target (H200), for device calls of <= 10 min.
# Each call starts a producer on the cache root in $R (created on the first call), trains DSpark at its GPU
# defaults (B 7, 5 layers, 512 anchors, vanilla Markov head rank 256) with --resume when a checkpoint is
# there, stops itself after LIM seconds (SIGTERM: the consumer checkpoints at the next step boundary), stops
# the producer, and copies the figures to $OUT. Once --steps are done it runs `artcache calibrate` and both
# exports. $R lives in /tmp, which the lent machine keeps only while it stays warm: a cold machine starts over.
# Needs SmolLM2 staged (../shared/gpu/stage-smollm2.sh): call 1 `bash .stage-a/keep.sh` (carry .stage-a),
# then every call: `source .stage-b/use.sh && bash bench/dspark_gpu_piece.sh` (carry .stage-b).
# Env: R (default /tmp/dspark-piece), LIM (default 480 s), STEPS (default 700: 700 x 8 samples stays
# clear of the plan's last 64 held-out samples of 6000); for a CPU dry run on a small target also TARGET,
# DATA, DEVICE, MAXLEN, NSAMP, LAYERS (defaults: SmolLM2, /tmp/sharegpt.jsonl, cuda, 1024, 6000,
# 1,8,14,20,27,29) and EVAL (held-out samples, default 64).
set -u
R=${R:-/tmp/dspark-piece}
LIM=${LIM:-480}
STEPS=${STEPS:-700}
OUT=${OUT:-$R/out}
TARGET=${TARGET:-smollm2-135m-instruct}; DATA=${DATA:-/tmp/sharegpt.jsonl}; DEVICE=${DEVICE:-cuda}
MAXLEN=${MAXLEN:-1024}; NSAMP=${NSAMP:-6000}; LAYERS=${LAYERS:-1,8,14,20,27,29}
mkdir -p "$R" "$OUT"
if [ ! -e "$R/done" ]; then
  python -m artcache producer --cache "$R/cache" --target "$TARGET" --data "$DATA" \
    --max-length "$MAXLEN" --max-samples "$NSAMP" --layer-ids "$LAYERS" --device "$DEVICE" \
    --batch-samples 16 --batch-tokens 16384 > "$R/producer.log" 2>&1 &
  P=$!
  for _ in $(seq 300); do grep -q "producer ready" "$R/producer.log" && break; sleep 1; done
  RES=; [ -e "$R/run/checkpoints/latest" ] && RES=--resume
  timeout -s TERM "$LIM" python -m artcache consume --cache "$R/cache" --draft dspark --id dspark-b7 \
    --device "$DEVICE" --batch-size 8 --steps "$STEPS" --lr 6e-4 --window 64:256 --save-every 50 \
    --eval-samples "${EVAL:-64}" --eval-interval 350 --eval-anchors 128 --log-every 25 --out "$R/run" --no-progress \
    $RES > "$R/consume.out" 2>> "$R/consume.err"
  rc=$?
  kill -TERM "$P"; wait "$P"
  echo "consume rc=$rc ($([ -n "$RES" ] && echo resumed || echo fresh)); producer stopped"
  [ "$rc" = 0 ] && touch "$R/done"
fi
if [ -e "$R/done" ] && [ ! -e "$R/calibration.out" ]; then
  python -m artcache calibrate --checkpoint "$R/run" > "$R/calibration.out" 2>&1
  python -m artcache export --checkpoint "$R/run" --format speculators --out "$R/export-speculators" --overwrite
  python -m artcache export --checkpoint "$R/run" --format hf --out "$R/export-hf" --overwrite
fi
cp "$R/run/metrics.csv" "$R/consume.out" "$OUT/" 2>/dev/null
[ -e "$R/calibration.out" ] && cp "$R/calibration.out" "$OUT/"
tail -n 40 "$R/consume.err" > "$OUT/consume.tail"; tail -n 5 "$R/producer.log" > "$OUT/producer.tail"
grep -h "step [0-9]*/\|eval step\|resumed\|checkpoint" "$R/consume.err" | tail -n 8
