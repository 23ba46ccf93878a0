# session 13 (2026-12-04), chain call 1 on a cold machine, carry [".stage-a", ".gpu"] (.gpu/whl: msgspec, filelock,
# gguf wheels; .gpu/COMMIT):  bash .stage-a/keep.sh && bash configs/h200/s13-call1.sh
# bench.offline on the machine's idle CPU cores (issue 21: a --fill'ed root against the in-memory rate), both arms in
# each consumer's process (--pairing process), each consumer pinned to physical cores of its own (--pin auto), the
# consumers' default --commit-interval (COMMIT=0: a commit after every step, the rule before); no staged target needed.
set -uo pipefail
t0=$(date +%s)
mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site ${WHL:-.gpu/whl}/*.whl || exit 8
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; uptime
lscpu | grep -E "^(Model name|Thread|Core|Socket|NUMA node\(s\))"
tag=offline-commit${COMMIT:-default}
timeout -k 10 ${OFFLINE_S:-480} python3 -m artcache.bench.offline --out /tmp/$tag --target random:tiny-llama \
  --data synthetic --max-samples 80 --max-length 128 --steps 60 --warmup 3 --rounds ${ROUNDS:-6} --anchors 8 \
  --pairing process ${COMMIT:+--commit-interval $COMMIT} > $R/$tag.log 2>&1
echo "offline exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/$tag.log
tail -40 $R/$tag.log
cp $R/$tag.log $OUT/; cp /tmp/$tag/report.json $OUT/$tag-report.json 2>/dev/null
echo "call done at $(( $(date +%s) - t0 )) s"
