# session 11 (2026-12-03), chain 2, call 2 after call1.sh (stage-smollm2.sh 12000; carry .stage-b and .gpu; run as
# `source .stage-b/use.sh && bash configs/h200/s11-call2.sh`): the from-cache rows with CUDA graphs and 1/2/4 read
# workers (chain 1 found the step host-bound and the single reader at its limit with graphs), then bench.offline on
# the idle CPU cores with more steps and rounds than chain 1's (its rounds varied 1.9x on an idle machine).
set -uo pipefail
t0=$(date +%s)
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; uptime
timeout -k 10 ${CSPEED_S:-270} python3 -m artcache.bench.consumer_speed --out /tmp/cspeed2 --root /tmp/cs2root \
  --cache-steps 200 \
  --plan "${CSPEED_PLAN:-cache-dflash:syncfree+graphs@4,cache-dflash:syncfree+graphs@2,cache-dflash:syncfree+compile@4,cache-dflash:syncfree+graphs@1,dflash:syncfree+graphs,cache-eagle3:syncfree+graphs@4}" \
  --budget-s $(( ${CSPEED_S:-270} - 40 )) > $R/cspeed2.log 2>&1
echo "consumer_speed exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/cspeed2.log
cp /tmp/cspeed2/consumer_speed.json $OUT/consumer_speed2.json 2>/dev/null
(cd /tmp/cspeed2 && tar cJf $OUT/profiles2.tar.xz profile-*.txt 2>/dev/null)
grep -vE "^\{" $R/cspeed2.log | tail -20
cp $R/cspeed2.log $OUT/
left=$(( t0 + ${CALL_S:-570} - $(date +%s) ))
uptime
timeout -k 10 $left python3 -m artcache.bench.offline --out /tmp/offline2 --target random:tiny-llama --data synthetic \
  --max-samples 80 --max-length 128 --steps ${OFFLINE_STEPS:-60} --warmup 3 --rounds ${OFFLINE_ROUNDS:-5} --anchors 8 \
  > $R/offline2.log 2>&1
echo "offline exit $? after $(( $(date +%s) - t0 )) s (bound $left s)" | tee -a $R/offline2.log
grep -A4 '"root_over_memory"\|"root_train_step_share"\|"cpu_root_over_memory"' $R/offline2.log | head -20
cp $R/offline2.log $OUT/; cp /tmp/offline2/report.json $OUT/offline2-report.json 2>/dev/null
echo "call done at $(( $(date +%s) - t0 )) s"
