# session 7, call 3: piece 2 of the DFlash-only long run until PIECE_END; if DFlash is done before it, the
# fp8-vs-bf16 held-out τ comparison (bench/fp8_tau.py) in what is left. LONG_CONFIG: another one-draft long run;
# AFTER=offline (session 12): bench.offline on the then idle CPU instead of fp8_tau (issue 21)
set -uo pipefail
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res; t0=$(date +%s); end=$(( t0 + ${CALL_S:-520} ))
LONG_CONFIG=${LONG_CONFIG:-configs/gpu-smollm2-dflash.toml} PIECE_END=$end OUT=$OUT bash configs/gpu-smollm2-long.sh ${PIECE:-2}; rc=$?
left=$(( end - $(date +%s) ))
if (( rc == 0 && left > 120 )) && [ "${AFTER:-fp8}" = offline ]; then
  timeout -k 10 $left python3 -m artcache.bench.offline --out /tmp/offline --target random:tiny-llama --data synthetic \
    --max-samples 80 --max-length 128 --steps ${OFFLINE_STEPS:-60} --warmup 3 --rounds ${OFFLINE_ROUNDS:-6} --anchors 8 \
    --pairing process > $R/offline.log 2>&1; echo "offline exit $? after $(( $(date +%s) - t0 )) s (bound $left s)" | tee -a $R/offline.log
  tail -25 $R/offline.log; cp /tmp/offline/report.json $OUT/offline-report.json 2>/dev/null
elif (( rc == 0 && left > 150 )); then
  timeout -k 10 $left python3 -m artcache.bench.fp8_tau --out /tmp/fp8tau --device cuda --steps ${FP8_STEPS:-300} \
    --data /tmp/sharegpt.jsonl > $R/fp8_tau.log 2>&1; echo "fp8_tau exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/fp8_tau.log
  cp /tmp/fp8tau/fp8_tau.json /tmp/fp8tau/fp8_tau.md $OUT/ 2>/dev/null; tail -30 $R/fp8_tau.log
fi
tar -C $R -czf $OUT/call3-res.tgz .
echo "call 3 done rc=$rc at $(( $(date +%s) - t0 )) s"
