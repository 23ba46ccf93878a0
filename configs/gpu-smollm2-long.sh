#!/usr/bin/env bash
# One piece (at most 5 minutes) of the long DFlash + EAGLE-3 run of configs/gpu-smollm2-long.toml on the
# lent H200 with the real SmolLM2 target. Piece 1 starts fresh; piece 2 resumes both experiments from
# their checkpoints (resume = true: refused with exit 2, in seconds, when they are gone) and raises their
# `steps` to 2 x (700 DFlash, 500 EAGLE-3). Here, in the project root, once:
#   bash ../shared/gpu/stage-smollm2.sh             # 6,000 conversations (epochs wrap; the split is never read)
# then device calls back to back (each within 30 s of the last; the machine keeps /tmp while warm):
#   call 1  carry [".stage-a"]   bash .stage-a/keep.sh
#   call 2  carry [".stage-b"]   source .stage-b/use.sh && bash configs/gpu-smollm2-long.sh 1
#   call 3  carry [".stage-b"]   source .stage-b/use.sh && bash configs/gpu-smollm2-long.sh 2   (optional)
# artcache run is bounded to $PIECE_S seconds (default 230; stopping takes up to ~30 s more): past it,
# SIGTERM is forwarded, every consumer checkpoints its last step, and the script exits 3 (not timeout's 124,
# which the device tool reads as its own limit); the next piece resumes from those checkpoints.
# Brought back under $OUT/piece-K/: run.log, report.txt (artcache report), report.json, the two
# metrics.csv files (held-out figures: eval/replay_tau, greedy replay incl. the +1 bonus token).
set -uo pipefail
piece=${1:?usage: gpu-smollm2-long.sh PIECE (1 or 2)}
[[ $piece =~ ^[12]$ ]] || { echo "PIECE must be 1 or 2 (the LR horizon covers two), got $piece" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
cfg=$root/configs/gpu-smollm2-long.toml
run=${LONG_OUT:-/tmp/artcache-long}                 # the run directory (the config's out)
res=${OUT:-$root/gpu-long-out}/piece-$piece
mkdir -p "$res"
export ARTCACHE_HOME=${ARTCACHE_HOME:-/tmp/artcache-home}   # the converted target, kept for later pieces
# The subpackages artcache.trainers / artcache.bench live in trainers/ and bench/ (setuptools package-dir);
# an uninstalled checkout on PYTHONPATH (use.sh's PYTHONPATH=$PWD) lacks them, so mirror the installed
# layout with links under /tmp, first on the path (PYTHONSAFEPATH: `python3 -m`/`-c` would otherwise put
# the working directory, this checkout's bare artcache/, first). Where artcache.trainers already imports
# (an installed tree, e.g. after `source .gpu/setup.sh`, which pip-installs -e it), the links are skipped.
export PYTHONUNBUFFERED=1
if ! python3 -c 'import artcache.trainers, artcache.bench' 2>/dev/null; then
  pkg=/tmp/artcache-pkg
  rm -rf "$pkg" && mkdir -p "$pkg/artcache" || exit 1
  for f in "$root"/artcache/*; do ln -s "$f" "$pkg/artcache/"; done
  ln -s "$root/trainers" "$pkg/artcache/trainers" && ln -s "$root/bench" "$pkg/artcache/bench" || exit 1
  export PYTHONPATH=$pkg${PYTHONPATH:+:$PYTHONPATH} PYTHONSAFEPATH=1
  python3 -c 'import artcache.trainers, artcache.bench' || { echo "artcache.trainers does not import" >&2; exit 1; }
fi
resume=()
if (( piece > 1 )); then resume=(experiments.dflash.resume=true experiments.eagle3.resume=true); fi
t0=$(date +%s)
# LONG_EXTRA: further SECTION.FIELD=VALUE overrides (the CPU check of this script uses a tiny target)
# shellcheck disable=SC2086
timeout -s TERM -k 45 "${PIECE_S:-230}" python3 -m artcache run --config "$cfg" out="$run" \
  experiments.dflash.steps=$((700 * piece)) experiments.eagle3.steps=$((500 * piece)) "${resume[@]}" \
  ${LONG_EXTRA:-} 2>&1 | tee "$res/run.log"
rc=${PIPESTATUS[0]}
if (( rc == 124 )); then echo "piece $piece stopped at its ${PIECE_S:-230} s bound (checkpoints written)"; rc=3; fi
echo "piece $piece: artcache run exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$res/run.log"
python3 -m artcache report "$run" > "$res/report.txt" 2>&1
cp "$run/report.json" "$res/report.json" 2>/dev/null
for x in dflash eagle3; do cp "$run/experiments/$x/metrics.csv" "$res/$x-metrics.csv" 2>/dev/null; done
cat "$res/report.txt"
exit "$rc"
