#!/bin/bash
# A fake 3-node Slurm cluster on this machine, for the `slurm` tests: as root, no systemd, loopback only.
# Nodes n1-n3 are slurmd processes on 127.0.0.1 (ports 17001-17003), two fake GPUs each (character
# devices aliasing /dev/null, so --gres=gpu:1 sets CUDA_VISIBLE_DEVICES). Adapted from the team's verified
# recipe (shared/scale-out/slurm-ci.sh): same slurm.conf, start and teardown order.
#
#   bash .ci/slurm-cluster.sh start DIR   install Debian's slurmd slurmctld slurm-client munge if missing,
#                                         start munged (if none runs), slurmctld, 3 slurmd; wait until idle;
#                                         print the SLURM_CONF to export
#   bash .ci/slurm-cluster.sh stop DIR    slurmds first (one whose controller is gone can hang), then
#                                         slurmctld, then the munged this script started
set -euo pipefail
cmd=${1:?usage: slurm-cluster.sh start|stop DIR}
D=${2:?usage: slurm-cluster.sh start|stop DIR}
D=$(realpath -m "$D")

stop_pid() {  # stop_pid PIDFILE: SIGTERM, wait up to 10 s, then SIGKILL
  local p
  p=$(cat "$1" 2>/dev/null) || return 0
  kill "$p" 2>/dev/null || return 0
  for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || return 0; sleep 0.1; done
  echo "slurm-cluster: $1 needed SIGKILL" >&2
  kill -9 "$p" 2>/dev/null || true
}

if [ "$cmd" = stop ]; then
  for n in 1 2 3; do stop_pid "$D/run/slurmd-n$n.pid" & done
  wait
  stop_pid "$D/run/slurmctld.pid"
  if [ -f "$D/run/started-munge" ]; then stop_pid /run/munge/munged.pid; rm -f "$D/run/started-munge"; fi
  echo "slurm-cluster: stopped ($D)"
  exit 0
fi
[ "$cmd" = start ] || { echo "usage: slurm-cluster.sh start|stop DIR" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "slurm-cluster: needs root (slurmd runs jobs as any user)" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v srun >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  pkgs=(slurmd slurmctld slurm-client munge)
  apt-get install -y --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1 ||
    { apt-get update -qq && apt-get install -y --no-install-recommends "${pkgs[@]}" >/dev/null; }
fi
rm -rf "$D"
mkdir -p "$D"/{state,log,run,dev} "$D"/spool/n{1,2,3}
for i in 0 1; do mknod "$D/dev/gpu$i" c 1 3; done  # fake GPUs: character devices aliasing /dev/null
H=$(hostname)
cat >"$D/slurm.conf" <<EOF
ClusterName=artcache-ci
SlurmctldHost=$H(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MpiDefault=none
SlurmdParameters=config_overrides
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
NodeName=n[1-3] NodeHostname=$H NodeAddr=127.0.0.1 Port=[17001-17003] CPUs=2 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=2000 Gres=gpu:2
PartitionName=ci Nodes=n[1-3] Default=YES MaxTime=30 State=UP
EOF
printf 'AutoDetect=off\nNodeName=n[1-3] Name=gpu File=%s/dev/gpu[0-1]\n' "$D" >"$D/gres.conf"
export SLURM_CONF=$D/slurm.conf
if ! munge -n >/dev/null 2>&1; then
  mkdir -p /run/munge && chown munge:munge /run/munge
  [ -s /etc/munge/munge.key ] || { mungekey --create >/dev/null 2>&1 || true; chown munge:munge /etc/munge/munge.key; }
  runuser -u munge -- munged --num-threads=1
  touch "$D/run/started-munge"
fi
slurmctld -c -f "$SLURM_CONF"
for n in 1 2 3; do slurmd -N "n$n" -f "$SLURM_CONF"; done
for _ in $(seq 1 300); do
  [ "$(timeout 2 sinfo -h -o '%T %D' 2>/dev/null)" = "idle 3" ] && break
  sleep 0.1
done
state=$(timeout 2 sinfo -h -N -o '%N:%T:%G' 2>/dev/null | tr '\n' ' ')
case "$state" in
  *n1:idle*n2:idle*n3:idle*) ;;
  *) echo "slurm-cluster: the nodes did not become idle: $state (logs in $D/log)" >&2; bash "$0" stop "$D"; exit 1;;
esac
echo "slurm-cluster: idle: $state"
echo "SLURM_CONF=$SLURM_CONF"
