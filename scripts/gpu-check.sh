#!/usr/bin/env bash
# Checks vramguard against a real NVIDIA GPU, in under 5 minutes, and writes the results to a
# folder (to record in docs/gpu-results.md):
#   1. the release probe: TERM, INT and KILL, 3 repeats each, 4 GiB, with report and plots;
#   2. status/diagnose on real processes: a CUDA holder with two children that inherited its
#      context, after the parent is SIGKILLed (the DataLoader case), then reclaim;
#   3. `vramguard run` around a CUDA holder: the release summary with the driver's real lag;
#   4. the agent for 20 s around a killed CUDA holder: its metrics (release-lag histogram,
#      memory health, Xid event sets registered on the real driver) and /api/status.
# Usage: scripts/gpu-check.sh [VRAMGUARD_BINARY] [OUT_DIR] [GPU_INDEX]
# It starts only processes of its own, and kills them by pid.
set -uo pipefail
BIN=${1:-./vramguard}
OUT=${2:-./gpu-results}
GPU=${3:-0}
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/check.log"; }

log "vramguard: $BIN ($("$BIN" --version 2>&1))"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed"
BUS=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i "$GPU" | tr -d ' ')
log "GPU $GPU at $BUS"

log "status and diagnose before"
"$BIN" status >"$OUT/status-before.txt" 2>&1
"$BIN" status --json >"$OUT/status-before.json" 2>>"$OUT/check.log"
"$BIN" diagnose >"$OUT/diagnose-before.txt" 2>&1

log "probe release: TERM,INT,KILL x3, 4 GiB"
timeout 170 "$BIN" probe release --gpu "$GPU" --size 4GiB --signals TERM,INT,KILL --repeat 3 \
    --timeout 30s --report "$OUT/probe" >"$OUT/probe-release.txt" 2>&1
log "probe exit: $?"

log "orphans: a CUDA holder with 2 inheriting children; SIGKILL the parent"
"$BIN" __cuda-hold --pci "$BUS" --bytes $((2 << 30)) --children 2 --lifetime 120 >"$OUT/holder.out" 2>>"$OUT/check.log" &
for _ in $(seq 100); do grep -q '^ready' "$OUT/holder.out" 2>/dev/null && break; sleep 0.1; done
read -r _ PARENT CHILD1 CHILD2 <"$OUT/holder.out"
log "holder $PARENT, children $CHILD1 $CHILD2"
"$BIN" status >"$OUT/status-holder.txt" 2>&1
kill -KILL "$PARENT"
sleep 3
"$BIN" status >"$OUT/status-orphans.txt" 2>&1
"$BIN" status --json >"$OUT/status-orphans.json" 2>>"$OUT/check.log"
"$BIN" diagnose >"$OUT/diagnose-orphans.txt" 2>&1
log "diagnose exit: $?"
"$BIN" reclaim --yes --gpu "$GPU" --grace 5s --audit-log "$OUT/audit.jsonl" >"$OUT/reclaim.txt" 2>&1
log "reclaim exit: $?"
"$BIN" status >"$OUT/status-after.txt" 2>&1
for p in "$CHILD1" "$CHILD2"; do
    # Only if it is still the child we started (same command name).
    [ "$(cat /proc/"$p"/comm 2>/dev/null)" = vramguard ] && kill -KILL "$p"
done

log "run: a CUDA holder under vramguard run"
"$BIN" run --summary-json "$OUT/run-summary.json" -- "$BIN" __cuda-hold --pci "$BUS" --bytes $((4 << 30)) --lifetime 3 \
    >"$OUT/run.txt" 2>&1
log "run exit: $?"

log "agent: 20 s, a CUDA holder killed in the middle"
"$BIN" agent --listen 127.0.0.1:19835 --interval 1s >"$OUT/agent.log" 2>&1 &
AGENT=$!
sleep 3
"$BIN" __cuda-hold --pci "$BUS" --bytes $((2 << 30)) --lifetime 120 >"$OUT/agent-holder.out" 2>>"$OUT/check.log" &
HOLDER=$!
sleep 5
kill -KILL "$HOLDER"
sleep 10
curl -s 127.0.0.1:19835/metrics >"$OUT/agent-metrics.txt" 2>>"$OUT/check.log"
curl -s 127.0.0.1:19835/api/status >"$OUT/agent-status.json" 2>>"$OUT/check.log"
kill -TERM "$AGENT"
wait "$AGENT"
log "agent exit: $? (release lags: $(grep -c '^vramguard_release_lag_seconds_count' "$OUT/agent-metrics.txt"))"
log "done"
