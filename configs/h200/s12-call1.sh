# session 12 (2026-12-03), one call on a cold machine, carry [".gpu"] (.gpu/whl: msgspec, filelock, gguf wheels from
# ../shared/gpu/stage-smollm2.sh's .stage-b/whl; .gpu/COMMIT): no staged target is needed (random targets).
#   bash configs/h200/s12-call1.sh   (WHL: another folder of those wheels, e.g. .stage-a/whl in a staging call 1)
# consumer_speed from the cache at several GIL switch intervals (issue 20: the trainer thread's Python competes with
# the reader threads' Python): every row of the plan once per interval, the intervals in ABBA-like order; then, with
# CSPEED_PLAN2, a second plan in a process of its own (e.g. the Qwen3-8B-shaped in-memory rows).
set -uo pipefail
t0=$(date +%s)
mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site ${WHL:-.gpu/whl}/*.whl || exit 8
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; uptime
timeout -k 10 ${CSPEED_S:-400} python3 -m artcache.bench.consumer_speed --out /tmp/cspeed --cache-steps 200 \
  --plan "${CSPEED_PLAN:-cache-dflash:syncfree+graphs@2,cache-dflash:syncfree+graphs@1,cache-dflash:syncfree+compile@1,cache-eagle3:syncfree+compile@1}" \
  --switch-intervals-ms "${INTERVALS:-5,0.5,0.1,0.5,5}" --budget-s $(( ${CSPEED_S:-400} - 40 )) > $R/cspeed.log 2>&1
echo "consumer_speed exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/cspeed.log
cp /tmp/cspeed/consumer_speed.json $OUT/ 2>/dev/null
(cd /tmp/cspeed && tar cJf $OUT/profiles.tar.xz profile-*.txt 2>/dev/null)
grep -vE "^\{" $R/cspeed.log | tail -40
cp $R/cspeed.log $OUT/
if [ -n "${CSPEED_PLAN2:-}" ]; then  # a second plan in its own process at the default interval (in-memory rows)
  timeout -k 10 ${CSPEED2_S:-150} python3 -m artcache.bench.consumer_speed --out /tmp/cspeed2 --root /tmp/cspeed2-root \
    --plan "$CSPEED_PLAN2" --budget-s $(( ${CSPEED2_S:-150} - 40 )) > $R/cspeed2.log 2>&1
  echo "consumer_speed (plan 2) exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/cspeed2.log
  cp /tmp/cspeed2/consumer_speed.json $OUT/consumer_speed-2.json 2>/dev/null; cp $R/cspeed2.log $OUT/
  grep -vE "^\{" $R/cspeed2.log | tail -12
fi
echo "call done at $(( $(date +%s) - t0 )) s"
