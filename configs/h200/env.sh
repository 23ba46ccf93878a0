# source me on the device (after .stage-b/use.sh in call 2; alone in later calls of the same warm machine)
_root=$PWD
[ -d /tmp/site ] || { echo "no /tmp/site: the machine is not the staged one (call 1/2 did not run on it)"; return 3; }
_pkg=/tmp/artcache-pkg; rm -rf "$_pkg" && mkdir -p "$_pkg/artcache"
for f in "$_root"/artcache/*; do ln -s "$f" "$_pkg/artcache/"; done
ln -s "$_root/trainers" "$_pkg/artcache/trainers"; ln -s "$_root/bench" "$_pkg/artcache/bench"
export PYTHONPATH=$_pkg:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 ARTCACHE_HOME=/tmp/artcache-home
export ARTCACHE_COMMIT=${ARTCACHE_COMMIT:-$(cat "$_root/.gpu/COMMIT" 2>/dev/null)}  # the device gets a stale .git: write the commit to .gpu/COMMIT (carried) before the calls
python3 -c 'import artcache.trainers, artcache.bench, msgspec, filelock; print("artcache", artcache.__file__)' || return 4
mkdir -p /tmp/gpu-res
