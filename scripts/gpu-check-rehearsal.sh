#!/usr/bin/env bash
# Rehearses scripts/gpu-check.sh on vramguard's simulated driver, so that a GPU session (few,
# and minutes long) is not spent on a broken step: every step runs as it would on a GPU, with
# stand-ins for what this machine lacks (scripts/gpu-check/rehearsal/: a PyTorch whose CUDA
# calls create and grow contexts on the simulated driver, and an nvidia-smi that reads it).
# The figures it records are the simulator's, not silicon's: never copy them into
# docs/gpu-results.md.
# Usage: scripts/gpu-check-rehearsal.sh VRAMGUARD_BINARY OUT_DIR
#   OUT_DIR gets sim/ (the simulated node) and results/ (gpu-check's folder; its tarball is
#   OUT_DIR/results.tar.gz). GPU_CHECK_BUDGET and GPU_CHECK_PORT pass through; so does
#   VRAMGUARD_NVML_LIB: naming the simulator's libnvidia-ml.so.1 there makes every vramguard
#   of the check read the GPU through NVML (nvml-wrapper), as it does on silicon.
# As root it runs in a mount namespace of its own: the simulated driver reads the host's
# /proc through a bind mount made there, which the `unshare --mount-proc` of gpu-check's
# other-PID-namespace view does not cover (a real driver needs no /proc to number pids), and
# /dev/shm is a tmpfs of its own, gone with the namespace (the killed multiprocessing
# launchers leave their semaphores there, as they do on a GPU node).
# The simulated node's NVML clients hold the device files as driver 580's do
# (`nvml_client_files`: vramguard itself, and the agents, show as holders). Known difference
# from silicon: `vramguard run -- vramguard __cuda-hold` needs a real libcuda, so the `run`
# step records a job that used no GPU.
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: scripts/gpu-check-rehearsal.sh VRAMGUARD_BINARY OUT_DIR" >&2
    exit 2
fi
# The check leads a process group of its own, as it does when a person or the device tool
# starts it: its in-script cases need the script's group to have a live leader, which a
# caller's group need not have (a background job whose shell has exited). A process that
# leads no group can `setsid` without a fork (one that leads its group already needs none),
# so signals and the caller's wait reach the check itself.
leads_group() { [ "$(ps -o pgid= -p $$ | tr -d ' ')" = "$$" ]; }
if [ -z "${GPU_CHECK_REHEARSAL_INNER:-}" ]; then
    export GPU_CHECK_REHEARSAL_INNER=1
    if [ -e "$2" ] && { [ ! -d "$2" ] || [ -n "$(ls -A "$2")" ]; }; then
        echo "gpu-check-rehearsal: $2 exists and is not an empty folder: name a new or empty one" >&2
        exit 2
    fi
    SETSID=(setsid)
    leads_group && SETSID=()
    if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null; then
        exec unshare --mount --propagation private env GPU_CHECK_REHEARSAL_NS=1 \
            ${SETSID[@]+"${SETSID[@]}"} "$0" "$@"
    fi
    exec ${SETSID[@]+"${SETSID[@]}"} "$0" "$@"
fi
BIN=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
OUT=$2
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# The unprivileged view (uid 65534) reads the simulated node: the folder was checked empty
# (or made) above, so no one else's folder changes mode here.
chmod 755 "$OUT"
"$BIN" sim init --dir "$OUT/sim" --gpus 1 >/dev/null
PROC_ROOT=/proc
# Mounts only in a mount namespace of our own (the variable alone proves nothing).
if [ -n "${GPU_CHECK_REHEARSAL_NS:-}" ] &&
    [ "$(readlink /proc/self/ns/mnt)" != "$(readlink /proc/1/ns/mnt)" ]; then
    # Outside the simulated node's folder, and bound after every mode is set: a recursive
    # chmod through a bind of /proc would change the host's procfs entries.
    PROC_ROOT=$(mktemp -d "$OUT/host-proc.XXXXXX")
    mount --bind /proc "$PROC_ROOT"
    # A /dev/shm of its own: the check SIGKILLs multiprocessing launchers (and their resource
    # trackers), whose semaphores (sem.mp-*) would otherwise stay in the host's /dev/shm.
    mount -t tmpfs -o size=64m,mode=1777 gpu-check-rehearsal-shm /dev/shm
else
    echo "gpu-check-rehearsal: no mount namespace of its own (not root): the other-PID-namespace view will list host pids" >&2
fi
# As driver 580's NVML does, vramguard (an NVML client) holds the device files while it runs.
python3 - "$OUT/sim/state.json" "$PROC_ROOT" <<'PY'
import json, os, sys
path, proc = sys.argv[1], sys.argv[2]
with open(path) as f:
    state = json.load(f)
state["proc_root"] = proc
state["nvml_client_files"] = True
with open(path, "w") as f:
    json.dump(state, f, indent=2)
os.chmod(path, 0o644)
PY
export VRAMGUARD_SIM=$OUT/sim/state.json
export VRAMGUARD_BINARY=$BIN
export VRAMGUARD_CONFIG=none
export PATH=$HERE/gpu-check/rehearsal:$PATH
export PYTHONPATH=$HERE/gpu-check/rehearsal${PYTHONPATH:+:$PYTHONPATH}
export GPU_CHECK_TARBALL=$OUT/results.tar.gz
status=0
"$HERE/gpu-check.sh" "$BIN" "$OUT/results" 0 || status=$?
if [ "$PROC_ROOT" != /proc ]; then
    # The check removes the semaphores its killed launchers left (a GPU node's /dev/shm is
    # everyone's): none may be left in this one.
    left=$(find /dev/shm -mindepth 1 -maxdepth 1 -name 'sem.mp-*' | wc -l)
    echo "gpu-check-rehearsal: semaphores left in /dev/shm: $left" >>"$OUT/results/check.log"
    [ "$left" = 0 ] || { echo "gpu-check-rehearsal: the check left $left semaphore(s) in /dev/shm" >&2; status=1; }
    umount "$PROC_ROOT" && rmdir "$PROC_ROOT"
fi
exit "$status"
