# session 7, call 4: piece 3 if DFlash is not done (PIECE_S > 0); the DFlash best checkpoint's hf export brought
# back (xz, <= 15 MiB parts); the I/O micro on this commit; the issue-14 bench (10 + 60 steps) in what is left
set -uo pipefail
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res; t0=$(date +%s); run=/tmp/artcache-long; end=$(( t0 + ${CALL_S:-540} ))
if [ "${PIECE_S:-0}" -gt 0 ]; then LONG_CONFIG=configs/gpu-smollm2-dflash.toml OUT=$OUT bash configs/gpu-smollm2-long.sh ${PIECE:-3}; fi
ex=/tmp/exports; rm -rf $ex; mkdir -p $ex
python3 -m artcache export --checkpoint $run/experiments/dflash/checkpoints/best --format hf --out $ex/dflash-hf
du -sh $ex/*
tar -C $ex -cf - . | xz -1 -T8 > /tmp/exports.tar.xz; ls -la /tmp/exports.tar.xz
split -b 15M -d -a 1 /tmp/exports.tar.xz $OUT/exports.tar.xz.part-
sha256sum /tmp/exports.tar.xz | tee $OUT/exports.sha256
timeout -k 10 ${MICRO_S:-200} python3 -m artcache.bench.gpu_micro --out /tmp/micro --json $OUT/h200-micro.json \
  --roots /tmp/acroot,/dev/shm/acroot --reps 3 --blocks 16 --steps 10 > $R/micro.log 2>&1
echo "micro exit $? after $(( $(date +%s) - t0 )) s"; rm -rf /tmp/acroot /dev/shm/acroot /tmp/micro
left=$(( end - $(date +%s) ))
if (( left > 120 )); then
  timeout -k 20 $left python3 -m artcache bench --scenario all --device cuda --allow-shared-gpu --target random:qwen3-8b \
    --data synthetic --max-length 3072 --max-samples 400 --anchors 256 --warmup 10 --steps 60 --window 8:32 \
    --out /tmp/bench-all > $R/bench-all.log 2>&1
  echo "bench all exit $? after $(( $(date +%s) - t0 )) s" | tee -a $R/bench-all.log
  for sc in 1p1c 1p3c; do cp /tmp/bench-all/$sc/report.json $R/bench-all-$sc-report.json 2>/dev/null; done  # one report per scenario
  tail -c 5000 $R/bench-all.log
fi
tar -C $R -czf $OUT/call4-res.tgz .
echo "call 4 done at $(( $(date +%s) - t0 )) s"
