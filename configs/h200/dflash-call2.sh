# session 7, call 2: the GPU lane beside (regenerate every staged conversation in 4 processes, then piece 1 of
# the DFlash-only long run until PIECE_END); see README.md here. LONG_CONFIG: another one-draft long run (session 12:
# configs/gpu-smollm2-dspark.toml)
set -uo pipefail
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res; t0=$(date +%s)
( timeout -k 10 ${LANE_S:-420} python3 -m pytest -m gpu -k "not cpu" -v -rs -p no:cacheprovider --basetemp=/tmp/lane-bt tests/ \
    > $R/gpu-lane.log 2>&1; echo "gpu lane exit $? after $(( $(date +%s) - t0 )) s (bound ${LANE_S:-420} s)" >> $R/gpu-lane.log ) &
lane=$!
LONG_CONFIG=${LONG_CONFIG:-configs/gpu-smollm2-dflash.toml} REGEN_WORKERS=${REGEN_WORKERS:-4} REGEN_SHARD=${REGEN_SHARD:-3000} \
  REGEN_S=${REGEN_S:-300} PIECE_END=$(( t0 + ${CALL_S:-500} )) OUT=$OUT bash configs/gpu-smollm2-long.sh 1; rc=$?
cp /tmp/artcache-long-results/piece-1/regenerate.jsonl $R/ 2>/dev/null
wait $lane
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|gpu lane exit" $R/gpu-lane.log | tail -40
cp $R/gpu-lane.log $OUT/
tar -C $R -czf $OUT/call2-res.tgz .
echo "call 2 done rc=$rc at $(( $(date +%s) - t0 )) s"
