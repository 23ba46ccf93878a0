# session 7, call 4: piece 3 if DFlash is not done (PIECE_S > 0), the I/O micro on this commit, then the
# DFlash best checkpoint's hf export brought back (xz, <= 15 MiB parts)
set -uo pipefail
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res; t0=$(date +%s); run=/tmp/artcache-long
if [ "${PIECE_S:-0}" -gt 0 ]; then LONG_CONFIG=configs/gpu-smollm2-dflash.toml OUT=$OUT bash configs/gpu-smollm2-long.sh ${PIECE:-3}; fi
if [ "${MICRO:-1}" = 1 ]; then
  timeout -k 10 ${MICRO_S:-200} python3 -m artcache.bench.gpu_micro --out /tmp/micro --json $OUT/h200-micro.json \
    --roots /tmp/acroot,/dev/shm/acroot --reps 3 --blocks 16 --steps 10 > $R/micro.log 2>&1
  echo "micro exit $? after $(( $(date +%s) - t0 )) s"; cp $R/micro.log $OUT/
fi
ex=/tmp/exports; rm -rf $ex; mkdir -p $ex
python3 -m artcache export --checkpoint $run/experiments/dflash/checkpoints/best --format hf --out $ex/dflash-hf
du -sh $ex/*
tar -C $ex -cf - . | xz -1 -T8 > /tmp/exports.tar.xz; ls -la /tmp/exports.tar.xz
split -b 15M -d -a 1 /tmp/exports.tar.xz $OUT/exports.tar.xz.part-
sha256sum /tmp/exports.tar.xz | tee $OUT/exports.sha256
tar -C $R -czf $OUT/call4-res.tgz .
echo "call 4 done at $(( $(date +%s) - t0 )) s"
