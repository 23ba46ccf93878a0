#!/usr/bin/env bash
# One piece (at most ~9 minutes) of the long run of configs/gpu-smollm2-long.toml on the lent H200 with the
# real SmolLM2 target: DFlash, EAGLE-3 and DSpark, 10,000 steps each from one shared capture.
# Piece 1 first regenerates the data (`artcache regenerate --device cuda`: the target's own greedy answers to
# the staged ShareGPT prompts, in shards of $REGEN_SHARD records, new shards started while the last one's
# time still fits in $REGEN_S seconds; `--cache $REGEN_CACHE`, default auto = static on CUDA, each shard
# retried once with the dynamic cache if it fails), then starts the run fresh; every later piece resumes each experiment
# from its own checkpoint under `out` (which must still be there: the machine keeps /tmp only while warm).
# Here, in the project root, once:
#   bash ../shared/gpu/stage-smollm2.sh             # 6,000 conversations
# then device calls back to back (each within 30 s of the last):
#   call 1  carry [".stage-a"]   bash .stage-a/keep.sh
#   call 2  carry [".stage-b"]   source .stage-b/use.sh && bash configs/gpu-smollm2-long.sh 1
#   call K  carry [".stage-b"]   source .stage-b/use.sh && bash configs/gpu-smollm2-long.sh K   (K = 2, 3, ...)
# artcache run is bounded to $PIECE_S seconds (default 300; stopping takes up to ~45 s more): past it,
# SIGTERM is forwarded, every consumer checkpoints its last step, and the script exits 3 (not timeout's 124,
# which the device tool reads as its own limit); the next piece resumes from those checkpoints.
# Brought back as $OUT/piece-K.tgz: run.log, report.txt (artcache report), report.json, each experiment's
# metrics.csv (held-out figures every 1,000 steps: eval/replay_tau, greedy replay incl. the +1
# bonus token), and for piece 1 regenerate.jsonl (one JSON summary per shard: tokens/s).
set -uo pipefail
piece=${1:?usage: gpu-smollm2-long.sh PIECE (1, 2, ...)}
[[ $piece =~ ^[1-9][0-9]*$ ]] || { echo "PIECE must be a positive integer, got $piece" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
cfg=${LONG_CONFIG:-$root/configs/gpu-smollm2-long.toml}   # LONG_CONFIG: another run config (e.g. configs/gpu-smollm2-dflash.toml)
run=${LONG_OUT:-/tmp/artcache-long}                 # the run directory (the config's out)
regen=${REGEN_OUT:-/tmp/regen.jsonl}                # the config's data.dataset
res=/tmp/artcache-long-results/piece-$piece
rm -rf "$res" && mkdir -p "$res"
export ARTCACHE_HOME=${ARTCACHE_HOME:-/tmp/artcache-home}   # the converted target, kept for later pieces
export PYTHONUNBUFFERED=1
# The subpackages artcache.trainers / artcache.bench live in trainers/ and bench/ (setuptools package-dir);
# an uninstalled checkout on PYTHONPATH lacks them, so mirror the installed layout with links under /tmp
# (skipped where artcache.trainers already imports, e.g. after `source .gpu/setup.sh`).
if ! python3 -c 'import artcache.trainers, artcache.bench' 2>/dev/null; then
  pkg=/tmp/artcache-pkg
  rm -rf "$pkg" && mkdir -p "$pkg/artcache" || exit 1
  for f in "$root"/artcache/*; do ln -s "$f" "$pkg/artcache/"; done
  ln -s "$root/trainers" "$pkg/artcache/trainers" && ln -s "$root/bench" "$pkg/artcache/bench" || exit 1
  export PYTHONPATH=$pkg${PYTHONPATH:+:$PYTHONPATH} PYTHONSAFEPATH=1
  python3 -c 'import artcache.trainers, artcache.bench' || { echo "artcache.trainers does not import" >&2; exit 1; }
fi
if (( piece == 1 )) && [ ! -s "$regen" ]; then
  src=${REGEN_SOURCE:-/tmp/sharegpt.jsonl}; shards=/tmp/regen-shards; shard=${REGEN_SHARD:-512}
  rm -rf "$shards" && mkdir -p "$shards" && split -d -a 3 -l "$shard" "$src" "$shards/in-" || exit 1
  t0=$(date +%s); workers=${REGEN_WORKERS:-1}
  [[ $workers =~ ^[1-9][0-9]*$ ]] || { echo "REGEN_WORKERS must be a positive integer, got $workers" >&2; exit 2; }
  regen_shard() {  # $1: shard number, $2: --cache (auto = static on CUDA: one compiled decode step for every batch)
    python3 -m artcache regenerate --out "$shards/out-$1.jsonl" --target "${REGEN_TARGET:-smollm2-135m-instruct}" \
      --data "$shards/in-$1" --max-samples "$shard" --max-new-tokens "${REGEN_NEW:-256}" --max-prompt-tokens 768 \
      --batch-size "${REGEN_BATCH:-256}" --device "${REGEN_DEVICE:-cuda}" --cache "$2" --force --no-progress \
      > "$shards/summary-$1.jsonl"
  }
  regen_worker() {  # $1: worker index: shards w, w + workers, ... one after the other, each started while it fits
    local i=0 last=0 k s0 now
    for f in "$shards"/in-*; do
      k=${f##*/in-}
      (( i++ % workers == $1 )) || continue
      now=$(( $(date +%s) - t0 ))
      (( now + last <= ${REGEN_S:-150} )) || { echo "regenerate worker $1: $now s used, shard $k would pass ${REGEN_S:-150} s"; break; }
      s0=$(date +%s)
      regen_shard "$k" "${REGEN_CACHE:-auto}" || { echo "regenerate of shard $k failed with --cache ${REGEN_CACHE:-auto}; once more with --cache dynamic" >&2; regen_shard "$k" dynamic; } \
        || { echo "regenerate of shard $k failed twice: left out" >&2; rm -f "$shards/out-$k.jsonl"; }
      last=$(( $(date +%s) - s0 ))
    done
  }
  # REGEN_WORKERS processes at once (the 135M target leaves the GPU mostly idle: one process is host-bound)
  pids=(); for (( w = 0; w < workers; w++ )); do regen_worker "$w" & pids+=($!); done
  for p in "${pids[@]}"; do wait "$p"; done
  compgen -G "$shards/out-*.jsonl" > /dev/null || { echo "regenerate: no shard finished" >&2; exit 1; }
  cat "$shards"/summary-*.jsonl >> "$res/regenerate.jsonl" 2>/dev/null
  mkdir -p "$(dirname "$regen")" && cat "$shards"/out-*.jsonl > "$regen.tmp" && mv "$regen.tmp" "$regen" || exit 1
  echo "regenerated $(wc -l < "$regen") records in $(( $(date +%s) - t0 )) s"
fi
t0=$(date +%s)
# PIECE_END (epoch seconds): the run's bound is what is left until then (a call that regenerates first)
if [ -n "${PIECE_END:-}" ]; then
  PIECE_S=$(( PIECE_END - t0 ))
  (( PIECE_S >= 90 )) || { echo "piece $piece: ${PIECE_S} s left before PIECE_END, too little to start the run"; exit 3; }
fi
# LONG_EXTRA: further SECTION.FIELD=VALUE overrides (the CPU check of this script uses a tiny target)
# shellcheck disable=SC2086
timeout -s TERM -k 45 "${PIECE_S:-300}" python3 -m artcache run --config "$cfg" out="$run" data.dataset="$regen" \
  ${LONG_EXTRA:-} 2>&1 | tee "$res/run.log"
rc=${PIPESTATUS[0]}
if (( rc == 124 )); then echo "piece $piece stopped at its ${PIECE_S:-300} s bound (checkpoints written)"; rc=3; fi
echo "piece $piece: artcache run exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$res/run.log"
python3 -m artcache report "$run" > "$res/report.txt" 2>&1
cp "$run/report.json" "$res/report.json" 2>/dev/null
for d in "$run"/experiments/*/; do
  x=$(basename "$d"); cp "$d/metrics.csv" "$res/$x-metrics.csv" 2>/dev/null
done
back=${OUT:-$root/gpu-long-out}
mkdir -p "$back" && tar -C "$(dirname "$res")" -czf "$back/piece-$piece.tgz" "piece-$piece"
cat "$res/report.txt"
exit "$rc"
