# call 2: A/B of regenerate's KV cache (dynamic vs static) on the first 256 usable prompts, then piece 1
set -uo pipefail
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res; t0=$(date +%s)
head -512 /tmp/sharegpt.jsonl > /tmp/ab.jsonl
for c in dynamic static; do
  s=$(date +%s)
  timeout 200 python3 -m artcache regenerate --out /tmp/ab-$c.jsonl --data /tmp/ab.jsonl --max-samples 256 \
    --max-new-tokens 64 --max-prompt-tokens 768 --batch-size 256 --device cuda --cache $c --force --no-progress \
    > $R/ab-$c.json 2> $R/ab-$c.err
  echo "ab $c rc=$? wall $(( $(date +%s) - s )) s"; tail -c 600 $R/ab-$c.json; echo
done
python3 - <<'PY' | tee $R/ab-compare.txt
import json
a = [json.loads(l) for l in open("/tmp/ab-dynamic.jsonl")]; b = [json.loads(l) for l in open("/tmp/ab-static.jsonl")]
same = sum(x["conversations"][-1]["value"] == y["conversations"][-1]["value"] for x, y in zip(a, b))
print(f"answers identical dynamic vs static: {same} of {len(a)} (bf16 greedy)")
PY
echo "A/B done at $(( $(date +%s) - t0 )) s"
REGEN_SHARD=${REGEN_SHARD:-2048} REGEN_S=${REGEN_S:-200} PIECE_S=${PIECE_S:-100} OUT=$OUT bash configs/gpu-smollm2-long.sh 1
rc=$?
cp /tmp/artcache-long-results/piece-1/regenerate.jsonl $R/ 2>/dev/null
tar -C $R -czf $OUT/call2-res.tgz .
echo "call 2 done rc=$rc at $(( $(date +%s) - t0 )) s"
