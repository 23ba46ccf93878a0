# session 9, call 3 (carry .gpu): issue 21's hetero scenario on the real SmolLM2 (staged), every retention mode
set -uo pipefail
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res; t0=$(date +%s)
timeout -k 20 ${HETERO_S:-540} python3 -m artcache bench --scenario hetero --device cuda --allow-shared-gpu \
  --target smollm2-135m-instruct --data /tmp/sharegpt.jsonl --max-length 1024 --max-samples 4000 --batch-size 8 \
  --window 64:512 --warmup ${WARMUP:-20} --steps ${STEPS:-300} --save none --out /tmp/hetero > $R/hetero.log 2>&1
echo "hetero exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/hetero.log
cp /tmp/hetero/hetero/report.json $OUT/hetero-report.json 2>/dev/null; cp /tmp/hetero/hetero/report.md $OUT/hetero-report.md 2>/dev/null
cp /tmp/hetero/report.json $OUT/hetero-run-report.json 2>/dev/null
tail -c 6000 $R/hetero.log; cp $R/hetero.log $OUT/
echo "call 3 done at $(( $(date +%s) - t0 )) s"
