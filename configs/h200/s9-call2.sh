# session 9, call 2 (after call1.sh; carry .stage-b and .gpu): the GPU lane alone on the GPU, then the consumer's
# from-cache rate with 1 read worker against the auto 4 (compiled, SmolLM2 shapes), in-memory rows beside
set -uo pipefail
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res; t0=$(date +%s)
timeout -k 10 ${LANE_S:-330} python3 -m pytest -m gpu -k "not cpu" -v -rs -p no:cacheprovider --basetemp=/tmp/lane-bt \
  tests/ > $R/gpu-lane.log 2>&1
echo "gpu lane exit $? after $(( $(date +%s) - t0 )) s (bound ${LANE_S:-330} s)" >> $R/gpu-lane.log
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|gpu lane exit" $R/gpu-lane.log | tail -40
cp $R/gpu-lane.log $OUT/
left=$(( t0 + ${CALL_S:-575} - $(date +%s) ))
timeout -k 10 $left python3 -m artcache.bench.consumer_speed --out /tmp/cspeed --no-profile --cache-steps 200 \
  --plan "cache-dflash:syncfree+compile@1,cache-dflash:syncfree+compile,cache-eagle3:syncfree+compile@1,cache-eagle3:syncfree+compile,dflash:syncfree+compile,eagle3:syncfree+compile" \
  --budget-s $(( left - 50 )) > $R/cspeed.log 2>&1
echo "consumer_speed exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/cspeed.log
cp /tmp/cspeed/consumer_speed.json $OUT/ 2>/dev/null
grep -vE "^\{" $R/cspeed.log | tail -30
cp $R/cspeed.log $OUT/
echo "call 2 done at $(( $(date +%s) - t0 )) s"
