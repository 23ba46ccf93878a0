# session 13, chain call 2 (same warm machine), carry [".stage-b", ".gpu"]:
#   source .stage-b/use.sh && bash configs/h200/s13-call2.sh
# the GPU lane (`pytest -m gpu -k "not cpu"`; its capture tests read the staged SmolLM2), the short GPU bench included
# (test_bench_1p1c_and_1p3c_short[cuda]).
set -uo pipefail
t0=$(date +%s)
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res
timeout -k 10 ${LANE_S:-540} python3 -m pytest -m gpu -k "not cpu" -v -rs -p no:cacheprovider --basetemp=/tmp/lane-bt \
  tests/ > $R/gpu-lane.log 2>&1
echo "gpu lane exit $? after $(( $(date +%s) - t0 )) s (bound ${LANE_S:-540} s)" >> $R/gpu-lane.log
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|gpu lane exit" $R/gpu-lane.log | tail -45
cp $R/gpu-lane.log $OUT/
