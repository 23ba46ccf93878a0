# session 11 (2026-12-03), one call on a cold machine, carry [".gpu"] (.gpu/whl: msgspec, filelock, gguf wheels from
# ../shared/gpu/stage-smollm2.sh's .stage-b/whl; .gpu/COMMIT): no staged target is needed (random targets).
#   bash configs/h200/s11-call.sh
# 1. consumer_speed, profiled: DFlash B16 from the cache (compiled; CUDA graphs; graphs + FlexAttention), then in
#    memory DFlash and DSpark (B7, 512 anchors) with and without FlexAttention / CUDA graphs;
# 2. bench.offline on the machine's idle CPU cores (issue 21: a --fill'ed root against the in-memory rate).
set -uo pipefail
t0=$(date +%s)
mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu/whl/*.whl || exit 8
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; uptime
timeout -k 10 ${CSPEED_S:-330} python3 -m artcache.bench.consumer_speed --out /tmp/cspeed --cache-steps 200 \
  --plan "${CSPEED_PLAN:-cache-dflash:syncfree+compile@1,cache-dflash:syncfree+graphs@1,cache-dflash:syncfree+graphs+flex@1,dflash:syncfree+compile,dflash:syncfree+graphs+flex,dspark:syncfree+compile,dspark:syncfree+compile+flex,dspark:syncfree+graphs+flex}" \
  --budget-s $(( ${CSPEED_S:-330} - 45 )) > $R/cspeed.log 2>&1
echo "consumer_speed exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/cspeed.log
cp /tmp/cspeed/consumer_speed.json $OUT/ 2>/dev/null
(cd /tmp/cspeed && tar cJf $OUT/profiles.tar.xz profile-*.txt 2>/dev/null)
grep -vE "^\{" $R/cspeed.log | tail -30
cp $R/cspeed.log $OUT/
left=$(( t0 + ${CALL_S:-585} - $(date +%s) ))
uptime
timeout -k 10 $left python3 -m artcache.bench.offline --out /tmp/offline --target random:tiny-llama --data synthetic \
  --max-samples 40 --max-length 128 --steps 20 --warmup 3 --rounds ${OFFLINE_ROUNDS:-4} --anchors 8 > $R/offline.log 2>&1
echo "offline exit $? after $(( $(date +%s) - t0 )) s (bound $left s)" | tee -a $R/offline.log
tail -25 $R/offline.log
cp $R/offline.log $OUT/; cp /tmp/offline/report.json $OUT/offline-report.json 2>/dev/null
echo "call done at $(( $(date +%s) - t0 )) s"
