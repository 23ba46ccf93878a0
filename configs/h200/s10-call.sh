# session 10 (2026-12-03), call 2 after call1.sh (stage-smollm2.sh 9000; carry .stage-b and .gpu; run as
# `source .stage-b/use.sh && bash configs/h200/s10-call.sh`): the consumer's from-cache rows with the trainer
# thread's host ms per phase and NVML utilisation (bench/consumer_speed.py), then the GPU lane (its capture tests
# need the staged SmolLM2's tokenizer) in what is left of CALL_S.
set -uo pipefail
t0=$(date +%s)
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; df -h /tmp | tail -1
timeout -k 10 ${CSPEED_S:-110} python3 -m artcache.bench.consumer_speed --out /tmp/cspeed --no-profile --cache-steps 200 \
  --plan "cache-dflash:syncfree+compile@1,dflash:syncfree+compile" \
  --budget-s $(( ${CSPEED_S:-110} - 40 )) > $R/cspeed.log 2>&1
echo "consumer_speed exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/cspeed.log
cp /tmp/cspeed/consumer_speed.json $OUT/ 2>/dev/null
grep -vE "^\{" $R/cspeed.log | tail -14
cp $R/cspeed.log $OUT/
left=$(( t0 + ${CALL_S:-390} - $(date +%s) ))
timeout -k 10 $left python3 -m pytest -m gpu -k "not cpu" -v -rs -p no:cacheprovider --basetemp=/tmp/lane-bt \
  tests/ > $R/gpu-lane.log 2>&1
echo "gpu lane exit $? after $(( $(date +%s) - t0 )) s (bound $left s)" >> $R/gpu-lane.log
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|gpu lane exit" $R/gpu-lane.log | tail -40
cp $R/gpu-lane.log $OUT/
echo "call done at $(( $(date +%s) - t0 )) s"
