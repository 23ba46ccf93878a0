# session 9, call 4 (carry .gpu): the I/O micro with the 1 MiB read tail beside the 8 MiB one; the from-cache rows
# again in the other order (4 read workers first) to tell the read-worker effect from the order
set -uo pipefail
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res; t0=$(date +%s)
timeout -k 10 ${MICRO_S:-220} python3 -m artcache.bench.gpu_micro --out /tmp/micro --json $OUT/h200-micro.json \
  --roots /tmp/acroot,/dev/shm/acroot --reps 3 --blocks 16 --steps 10 --io-variants legacy,no-tail,default > $R/micro.log 2>&1
echo "micro exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/micro.log; rm -rf /tmp/acroot /dev/shm/acroot /tmp/micro
tail -c 2500 $R/micro.log; cp $R/micro.log $OUT/
left=$(( t0 + ${CALL_S:-420} - $(date +%s) ))
timeout -k 10 $left python3 -m artcache.bench.consumer_speed --out /tmp/cspeed2 --no-profile --cache-steps 200 \
  --plan "cache-eagle3:syncfree+compile@4,cache-eagle3:syncfree+compile@1,cache-dflash:syncfree+compile@4,cache-dflash:syncfree+compile@1,cache-eagle3:syncfree+compile@2" \
  --budget-s $(( left - 40 )) > $R/cspeed2.log 2>&1
echo "consumer_speed exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/cspeed2.log
cp /tmp/cspeed2/consumer_speed.json $OUT/consumer_speed2.json 2>/dev/null
grep -vE "^\{" $R/cspeed2.log | tail -12; cp $R/cspeed2.log $OUT/
echo "call 4 done at $(( $(date +%s) - t0 )) s"
