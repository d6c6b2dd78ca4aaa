#!/usr/bin/env bash
# Slurm epilog: after a job ends, check that the GPUs it used are clean; reclaim what its
# orphans still hold; drain the node, with the reason, when memory stays held (driver
# residue, processes stuck in D state) so that the next job does not die of OOM.
#
# slurm.conf:  Epilog=/etc/slurm/epilog.d/vramguard.sh
# Environment from slurmd: SLURM_JOB_ID, SLURM_JOB_GPUS (e.g. "0,1"), SLURMD_NODENAME.
set -uo pipefail
VRAMGUARD=${VRAMGUARD:-/usr/local/bin/vramguard}
GPUS=${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}
NODE=${SLURMD_NODENAME:-$(hostname -s)}
LOG=${VRAMGUARD_EPILOG_LOG:-/var/log/vramguard/epilog.log}
mkdir -p "$(dirname "$LOG")"
log() { echo "$(date -Is) job=${SLURM_JOB_ID:-?} $*" >>"$LOG"; }

[ -n "$GPUS" ] || exit 0
[ -x "$VRAMGUARD" ] || { log "no vramguard at $VRAMGUARD"; exit 0; }

# The driver may take a few seconds to tear the job's contexts down.
for _ in 1 2 3 4 5 6; do
    "$VRAMGUARD" diagnose >/dev/null 2>&1 && { log "GPUs $GPUS clean"; exit 0; }
    sleep 5
done

log "GPUs $GPUS not clean after the job; reclaiming"
"$VRAMGUARD" reclaim --yes --gpu "$GPUS" --grace 10s --release-timeout 60s >>"$LOG" 2>&1
rc=$?
if [ $rc -eq 0 ]; then
    log "reclaimed"
    exit 0
fi
reason=$("$VRAMGUARD" diagnose --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["verdict"]["summary"][:200])' 2>/dev/null)
reason=${reason:-"vramguard: GPU memory still held after job ${SLURM_JOB_ID:-?}"}
log "draining $NODE: $reason"
scontrol update NodeName="$NODE" State=DRAIN Reason="vramguard: $reason" >>"$LOG" 2>&1
# An epilog failure would itself drain the node with a less useful reason: exit 0.
exit 0
