#!/usr/bin/env bash
# Slurm epilog: after a job ends, check that the GPUs it used are clean; reclaim what its
# orphans still hold; drain the node, with the reason, when memory stays held (driver
# residue, processes stuck in D state) so that the next job does not die of OOM.
#
# slurm.conf:  Epilog=/etc/slurm/epilog.d/vramguard.sh
# Environment from slurmd: SLURM_JOB_ID, SLURM_JOB_GPUS (e.g. "0,1"), SLURMD_NODENAME.
# Knobs: VRAMGUARD (the binary), VRAMGUARD_EPILOG_LOG, VRAMGUARD_AUDIT_LOG,
# VRAMGUARD_EPILOG_TRIES and VRAMGUARD_EPILOG_SLEEP (how long the driver gets to tear the
# job's contexts down before anything is reclaimed: 6 x 5 s by default); VRAMGUARD_HEAL=0
# leaves a drained node to the admin instead of `vramguard slurm heal` (which waits until no
# job runs on the node, VRAMGUARD_HEAL_WAIT, 1h by default, asking every VRAMGUARD_HEAL_POLL,
# 5s, then resets every GPU whose residue is proven under the --reset=auto rules and resumes
# the node once all its GPUs are clean).
set -uo pipefail
# One line per message in the log and in the drain reason, whatever the terminal.
export COLUMNS=1000
VRAMGUARD=${VRAMGUARD:-/usr/local/bin/vramguard}
GPUS=${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}
NODE=${SLURMD_NODENAME:-$(hostname -s)}
LOG=${VRAMGUARD_EPILOG_LOG:-/var/log/vramguard/epilog.log}
AUDIT=${VRAMGUARD_AUDIT_LOG:-/var/log/vramguard/audit.jsonl}
TRIES=${VRAMGUARD_EPILOG_TRIES:-6}
SLEEP=${VRAMGUARD_EPILOG_SLEEP:-5}
mkdir -p "$(dirname "$LOG")"
log() { echo "$(date -Is) job=${SLURM_JOB_ID:-?} $*" >>"$LOG"; }

[ -x "$VRAMGUARD" ] || { log "no vramguard at $VRAMGUARD"; exit 0; }

# The loop closed: once the node is idle, reset what only a reset frees and resume it. Only a
# drain whose reason still starts with "vramguard:" is touched (an admin's drain is theirs);
# a failed reset keeps the node drained with the reason updated. --detach starts it in a
# session of its own and returns once it is there: slurmd kills the epilog's process group
# when the epilog ends (`setsid … &` lost that race under load). One heal runs at a time per
# node (a second one finds the lock taken and does nothing).
schedule_heal() {
    [ "${VRAMGUARD_HEAL:-1}" != 0 ] || return 0
    # Its output (the pid first) goes to the log, never to slurmd's pipe.
    "$VRAMGUARD" slurm heal --detach --node "$NODE" \
        --wait "${VRAMGUARD_HEAL_WAIT:-1h}" --poll "${VRAMGUARD_HEAL_POLL:-5s}" \
        --audit-log "$AUDIT" >>"$LOG" 2>&1 </dev/null
    log "scheduled vramguard slurm heal for $NODE (exit $?)"
}

# Leaving a clean job: a heal that gave up waiting (a long job still ran when its --wait
# ended) left the node drained by vramguard; the epilog of a job that ends there starts the
# heal again, and that heal waits for this job to leave. The heal checks the drain itself;
# this only spares a heal start (and an audit record) per job on a node nobody drained.
heal_if_drained_by_us() {
    [ "${VRAMGUARD_HEAL:-1}" != 0 ] || return 0
    # Bounded: an unreachable slurmctld must not hold the epilog (and the job's end) up.
    timeout 30 scontrol show node "$NODE" --oneliner 2>/dev/null | grep -q ' Reason=vramguard:' ||
        return 0
    log "node $NODE is still drained by vramguard"
    schedule_heal
}

# No GPU list from slurmd (no GRES environment): the job's own leftovers are found by their
# cgroup (job_<id>, the layout vramguard reads for every view) on whatever GPU they hold, and
# only they are reclaimed.
if [ -z "$GPUS" ]; then
    [ -n "${SLURM_JOB_ID:-}" ] || exit 0
    "$VRAMGUARD" reclaim --yes --job "slurm:${SLURM_JOB_ID}" --grace 10s --release-timeout 60s \
        --audit-log "$AUDIT" >>"$LOG" 2>&1
    log "no SLURM_JOB_GPUS: reclaimed what job ${SLURM_JOB_ID}'s cgroup still held (exit $?)"
    heal_if_drained_by_us
    exit 0
fi

# Only the job's GPUs: another job's problem is that job's epilog's business.
for ((i = 1; i <= TRIES; i++)); do
    if "$VRAMGUARD" diagnose --gpu "$GPUS" >/dev/null 2>&1; then
        log "GPUs $GPUS clean"
        heal_if_drained_by_us
        exit 0
    fi
    [ "$i" -lt "$TRIES" ] && sleep "$SLEEP"
done

log "GPUs $GPUS not clean after the job; reclaiming"
"$VRAMGUARD" reclaim --yes --gpu "$GPUS" --grace 10s --release-timeout 60s \
    --audit-log "$AUDIT" >>"$LOG" 2>&1
rc=$?
if [ $rc -eq 0 ] && "$VRAMGUARD" diagnose --gpu "$GPUS" >/dev/null 2>&1; then
    log "reclaimed"
    heal_if_drained_by_us
    exit 0
fi
# The verdict line of the diagnosis is the reason an admin reads in `sinfo -R`.
reason=$(NO_COLOR=1 "$VRAMGUARD" diagnose --gpu "$GPUS" 2>&1 | sed -n 's/^verdict: //p' | head -c 200)
reason=${reason:-"GPU memory still held after job ${SLURM_JOB_ID:-?}"}
# A node someone else drained (or set down) stays theirs: writing our reason over theirs
# would make the heal take the drain for vramguard's, reset the GPUs and resume the node
# (a maintenance drain undone). Read with the same bound; unreadable, the drain goes ahead
# (an unreachable controller takes no update either).
node_line=$(timeout 30 scontrol show node "$NODE" --oneliner 2>/dev/null)
if printf '%s\n' "$node_line" | grep -q ' Reason=' &&
    ! printf '%s\n' "$node_line" | grep -q ' Reason=vramguard:'; then
    theirs=$(printf '%s\n' "$node_line" | sed -n 's/.* Reason=//p' | head -c 200)
    log "GPUs $GPUS not clean ($reason); $NODE is drained by someone else already ($theirs): their drain is left as it is, and no heal is scheduled"
    exit 0
fi
log "draining $NODE: $reason"
scontrol update NodeName="$NODE" State=DRAIN Reason="vramguard: $reason" >>"$LOG" 2>&1
schedule_heal
# An epilog failure would itself drain the node with a less useful reason: exit 0.
exit 0
