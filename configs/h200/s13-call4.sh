# session 13, call 4 (cold machine), carry [".gpu"] (.gpu/whl, .gpu/COMMIT):  bash configs/h200/s13-call4.sh
# bench.offline with the arms interleaved inside each consumer's process every 12 steps (--pairing steps), pinned,
# twice side by side: the consumers' default --commit-interval, then 0 (a commit after every step, the rule before).
set -uo pipefail
t0=$(date +%s)
mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu/whl/*.whl || exit 8
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res
nproc; uptime
for commit in default 0; do
  tag=offline-steps-commit$commit
  timeout -k 10 ${OFFLINE_S:-250} python3 -m artcache.bench.offline --out /tmp/$tag --target random:tiny-llama \
    --data synthetic --max-samples 160 --max-length 128 --steps 150 --warmup 3 --rounds ${ROUNDS:-2} --anchors 8 \
    --pairing steps --chunk 12 $([ $commit = default ] || echo --commit-interval $commit) > $R/$tag.log 2>&1
  echo "$tag exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/$tag.log
  grep -A12 '"root_over_memory"' $R/$tag.log | head -14
  cp $R/$tag.log $OUT/; cp /tmp/$tag/report.json $OUT/$tag-report.json 2>/dev/null
done
echo "call done at $(( $(date +%s) - t0 )) s"
