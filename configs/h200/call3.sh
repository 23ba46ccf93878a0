# call 3: piece 2 of the long run, the GPU lane beside it (same GPU, bounded)
set -uo pipefail
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res; t0=$(date +%s)
( timeout -k 10 ${LANE_S:-420} python3 -m pytest -m gpu -k "not cpu" -v -p no:cacheprovider --basetemp=/tmp/lane-bt tests/ \
    > $R/gpu-lane.log 2>&1; echo "gpu lane exit $? after $(( $(date +%s) - t0 )) s (bound ${LANE_S:-420} s)" >> $R/gpu-lane.log ) &
lane=$!
PIECE_S=${PIECE_S:-430} OUT=$OUT bash configs/gpu-smollm2-long.sh 2; rc=$?
wait $lane
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|gpu lane exit" $R/gpu-lane.log | tail -40
cp $R/gpu-lane.log $OUT/
echo "call 3 done rc=$rc at $(( $(date +%s) - t0 )) s"
