# session 13, chain call 3 (same warm machine), carry [".gpu"]:  bash configs/h200/s13-call3.sh
# 1. consumer_speed: DFlash B16 from the cache (CUDA graphs, 2 read workers) with a cursor commit after every step
#    (--commit-interval 0, the rule before) and the default interval, alternated (0, 0.25, 0, 0.25);
# 2. with the time left, bench.offline again with COMMIT (default 0: the rule before) beside call 1's run.
set -uo pipefail
t0=$(date +%s)
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res
timeout -k 10 ${CSPEED_S:-300} python3 -m artcache.bench.consumer_speed --out /tmp/cspeed --cache-steps 200 \
  --plan "${CSPEED_PLAN:-cache-dflash:syncfree+graphs@2}" --commit-intervals "${COMMITS:-0,0.25,0,0.25}" \
  --no-profile --budget-s $(( ${CSPEED_S:-300} - 40 )) > $R/cspeed.log 2>&1
echo "consumer_speed exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/cspeed.log
cp /tmp/cspeed/consumer_speed.json $OUT/ 2>/dev/null
grep -vE "^\{" $R/cspeed.log | tail -20
cp $R/cspeed.log $OUT/
left=$(( t0 + ${CALL_S:-580} - $(date +%s) ))
if [ $left -gt 120 ]; then
  COMMIT=${COMMIT:-0} OFFLINE_S=$left WHL=/nonexistent bash -c 'source configs/h200/env.sh >/dev/null; R=/tmp/gpu-res
    tag=offline-commit$COMMIT
    timeout -k 10 $OFFLINE_S python3 -m artcache.bench.offline --out /tmp/$tag --target random:tiny-llama \
      --data synthetic --max-samples 80 --max-length 128 --steps 60 --warmup 3 --rounds ${ROUNDS:-6} --anchors 8 \
      --pairing process --commit-interval $COMMIT > $R/$tag.log 2>&1
    echo "offline exit $? (bound $OFFLINE_S s)" | tee -a $R/$tag.log; tail -40 $R/$tag.log
    cp $R/$tag.log $OUT/; cp /tmp/$tag/report.json $OUT/$tag-report.json 2>/dev/null'
fi
echo "call done at $(( $(date +%s) - t0 )) s"
