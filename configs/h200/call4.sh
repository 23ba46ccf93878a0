# call 4: piece 3, then export each draft's best checkpoint and bring the exports back (<= 15 MiB parts)
set -uo pipefail
source configs/h200/env.sh || exit 9
R=/tmp/gpu-res; t0=$(date +%s); run=/tmp/artcache-long
if [ -n "${PIECE_S:-}" ] && [ "$PIECE_S" -gt 0 ]; then OUT=$OUT bash configs/gpu-smollm2-long.sh ${PIECE:-3}; fi
ex=/tmp/exports; rm -rf $ex; mkdir -p $ex
python3 -m artcache export --checkpoint $run/experiments/dflash/checkpoints/best --format hf --out $ex/dflash-hf
python3 -m artcache export --checkpoint $run/experiments/eagle3/checkpoints/best --format speculators --out $ex/eagle3-speculators
python3 -m artcache export --checkpoint $run/experiments/dspark/checkpoints/best --format hf --out $ex/dspark-hf
python3 - <<'PY'
# drop EAGLE-3's copy of the target embedding (restored here by bench/restore_embedding.py, sha256-checked)
import json
from safetensors.torch import load_file, save_file
from artcache.bench.restore_embedding import RECORD, tensor_sha256
d = "/tmp/exports/eagle3-speculators"; t = load_file(f"{d}/model.safetensors")
e = t.pop("embed_tokens.weight", None)
if e is not None:
    rec = {"embed_tokens.weight": {"shape": list(e.shape), "dtype": str(e.dtype), "sha256": tensor_sha256(e)}}
    json.dump(rec, open(f"{d}/{RECORD}", "w"), indent=1); save_file(t, f"{d}/model.safetensors")
    print("removed", rec)
PY
du -sh $ex/*
tar -C $ex -cf - . | xz -1 -T8 > /tmp/exports.tar.xz; ls -la /tmp/exports.tar.xz
split -b 15M -d -a 1 /tmp/exports.tar.xz $OUT/exports.tar.xz.part-
sha256sum /tmp/exports.tar.xz | tee $OUT/exports.sha256
tar -C $R -czf $OUT/call4-res.tgz .
echo "call 4 done at $(( $(date +%s) - t0 )) s"
