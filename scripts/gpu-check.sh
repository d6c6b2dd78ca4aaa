#!/usr/bin/env bash
# Checks vramguard against a real NVIDIA GPU with PyTorch in under 5 minutes (about 4.5 at
# most: every step has a budget and is skipped when too little time is left), writes every
# result into one folder and packs it into ONE tarball (to record in docs/gpu-results.md and
# to copy the snapshots into the incident corpus). In order of priority:
#   preflight   nvidia-smi, versions, status/diagnose before (and `import torch` warmed up);
#   trainer     case 1: `setsid python3 train.py 20 2` (20 GiB, 2 forked idle workers) in its
#               own job, SIGKILLed. With that one ghost: snapshot --sample 1s, status (text and
#               JSON), diagnose, metrics, nvidia-smi and --query-compute-apps (root); case 7:
#               the same seen as uid 65534 (setpriv) and from a new PID namespace (unshare);
#               case 6: an agent started before it (interval 500ms, ghost_bytes > 1GiB rule,
#               an exec sink) - its /metrics and whether the alert fired; case 5: a real
#               torch.OutOfMemoryError with vramguard.explain_oom(); then reclaim --yes and
#               the time until the memory is back;
#   in-script   case 2: the same trainer (2.5 GiB) sharing this script's process group;
#   spawned     case 3: torch.multiprocessing spawn workers (1 GiB each) of a SIGKILLed
#               launcher while this script lives;
#   busy        case 4: `setsid bash -c "python3 busy.py & exit 0"` (bf16 matmul loop):
#               reclaim --yes must leave it alive (checked by pid);
#   timing      case 8: status, status --sample 0s, status --json, status --full-scan,
#               nvidia-smi and nvidia-smi --query-compute-apps, 5 runs each (bash's `time`),
#               and which path status took (full_fd_scan);
#   nvml-calls  `probe calls --samples 200` (text and JSON): each NVML call of the agent's
#               sample timed on this driver;
#   agent-cost  case 9: the agent at --interval 500ms for 20 s on a quiet GPU: CPU per
#               sample (the process CPU clock over vramguard_collections_total) and RSS;
#   probe       the release probe: TERM and KILL, 3 repeats of 4 GiB, --rate 1000, report;
#   run         `vramguard run` around the built-in CUDA holder (3 s lifetime).
#   guard       `vramguard.guard()` in a live script ends its forked and its spawned CUDA
#               worker (scripts/gpu-check/guard.py): its log, its time, the memory back;
#   top-cost    `vramguard top` and (when installed) `nvitop --monitor full --interval 1` in a
#               200x50 pseudo-terminal, 10 s each (scripts/gpu-check/ptycost.py): CPU per
#               second and RSS of each on this GPU.
# Usage: scripts/gpu-check.sh [--dry-run] [VRAMGUARD_BINARY] [OUT_DIR] [GPU_INDEX]
#   VRAMGUARD_BINARY  default ./vramguard (a stripped release build)
#   OUT_DIR           the results folder, default ./gpu-results (an existing non-empty one is
#                     moved aside to OUT_DIR.prev-EPOCH first)
#   GPU_INDEX         the NVML index to use, default 0 (CUDA sees it as device 0)
# Environment:
#   GPU_CHECK_TARBALL  where the tarball goes; default $OUT/gpu-check.tar.gz when $OUT names a
#                      folder (the device machine's), else OUT_DIR.tar.gz
#   GPU_CHECK_BUDGET   seconds the whole check may take (default 270)
#   GPU_CHECK_DRY=1    same as --dry-run: print the plan and the step budgets, check the
#                      helpers parse, start nothing (needs no GPU)
#   GPU_CHECK_PORT     the agents' first loopback port (default 19835; the next one is used too)
# It needs nvidia-smi (it refuses to run without), python3 with PyTorch for the PyTorch cases,
# root for case 7 and for reclaim of other processes. It never resets the GPU nor changes its
# modes (reclaim runs with --reset never). Every process it starts carries GPU_CHECK_TAG in its
# environment; at the end (also on failure, SIGINT or SIGTERM) it kills, by pid, the pids it
# recorded and then every process still carrying its tag, and writes the tarball.
set -uo pipefail

DRY=${GPU_CHECK_DRY:-0}
case "${1:-}" in
    --dry-run) DRY=1; shift ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
BIN=${1:-./vramguard}
DIR=${2:-./gpu-results}
GPU=${3:-0}
BUDGET=${GPU_CHECK_BUDGET:-270}
PORT=${GPU_CHECK_PORT:-19835}
HERE=$(cd "$(dirname "$0")" && pwd)
HELPERS=$HERE/gpu-check
PYMOD=$(cd "$HERE/.." && pwd)/packaging/python/src
DIR=${DIR%/}
if [ -n "${GPU_CHECK_TARBALL:-}" ]; then
    TARBALL=$GPU_CHECK_TARBALL
elif [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    TARBALL=$OUT/gpu-check.tar.gz
else
    TARBALL=$DIR.tar.gz
fi
case "$TARBALL" in /*) ;; *) TARBALL=$PWD/$TARBALL ;; esac
case "$GPU" in '' | *[!0-9]*) echo "gpu-check: GPU_INDEX must be a number, not '$GPU'" >&2; exit 2 ;; esac

# --- time -------------------------------------------------------------------------------
now_ms() {
    if [ -n "${EPOCHREALTIME:-}" ]; then
        local t=${EPOCHREALTIME/[.,]/}
        echo $((t / 1000))
    else
        echo $(($(date +%s%N) / 1000000))
    fi
}
T0=$(now_ms)
elapsed_s() { echo $((($(now_ms) - T0) / 1000)); }

# --- the plan: name, budget (s), what ---------------------------------------------------
STEPS=(
    "preflight|10|nvidia-smi (-q too), versions, what an NVML client holds and whether nvmlShutdown lets go (nvml_files.py), status/status --json/diagnose before; import torch in the background"
    "trainer|62|cases 1+5+6+7: agent with a ghost_bytes rule; setsid train.py 20 GiB + 2 forked workers, SIGKILL; snapshot/status/diagnose/metrics/nvidia-smi as root, as uid 65534, from a new PID namespace; OOM with explain_oom(); agent /metrics; reclaim --yes + time to memory back"
    "in-script|30|case 2: train.py 2.5 GiB + 2 workers in this script's process group, SIGKILL; snapshot, status, reclaim --yes"
    "spawned|34|case 3: spawn_workers.py (2 spawned workers x 1 GiB), launcher SIGKILLed, script alive; snapshot, status, reclaim --yes"
    "busy|30|case 4: setsid bash -c 'python3 busy.py & exit 0' (bf16 matmul); status, snapshot, reclaim --yes; alive afterwards?"
    "timing|12|case 8: status, status --sample 0s, status --json, status --full-scan, nvidia-smi, nvidia-smi --query-compute-apps; 5 runs each; which path status took"
    "nvml-calls|8|probe calls --samples 200: what each NVML call of the agent's sample costs on this driver"
    "agent-cost|26|case 9: agent --interval 500ms, 20 s on a quiet GPU: CPU per sample and RSS"
    "probe|40|probe release --signals TERM,KILL --repeat 3 --size 4GiB --rate 1000 --report"
    "run|12|vramguard run -- __cuda-hold 4 GiB, lifetime 3 s (the run summary)"
    "guard|25|guard.py: vramguard.guard() ends a forked and a spawned CUDA worker of a live script (log, time, memory back)"
    "top-cost|26|vramguard top and nvitop (when installed) in a 200x50 pty, 10 s each: CPU per second and RSS"
)
budget_of() {
    local s
    for s in "${STEPS[@]}"; do
        [ "${s%%|*}" = "$1" ] && { s=${s#*|}; echo "${s%%|*}"; return; }
    done
    echo 0
}

if [ "$DRY" = 1 ]; then
    total=0
    echo "gpu-check plan (dry run: nothing is started)"
    echo "  binary $BIN; results $DIR; GPU $GPU; tarball $TARBALL; whole budget ${BUDGET}s"
    for s in "${STEPS[@]}"; do
        name=${s%%|*}; rest=${s#*|}; b=${rest%%|*}; what=${rest#*|}
        total=$((total + b))
        printf '  %-11s %3ss (ends by %3ss)  %s\n' "$name" "$b" "$total" "$what"
    done
    printf '  %-11s %3ss (ends by %3ss)  %s\n' pack 5 $((total + 5)) "kill leftovers by pid, summary.txt, tar -czf"
    total=$((total + 5))
    [ "$total" -le "$BUDGET" ] || echo "  note: the budgets add up to ${total}s > ${BUDGET}s: the last steps are skipped if the earlier ones use their whole budgets"
    rc=0
    for f in common.py train.py spawn_workers.py busy.py oom.py memwatch.py fetch.py guard.py ptycost.py nvml_files.py; do
        if python3 -c 'import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])' "$HELPERS/$f"; then
            echo "  helper ok: scripts/gpu-check/$f"
        else
            rc=1
        fi
    done
    if [ -f "$PYMOD/vramguard/__init__.py" ]; then
        echo "  python module: $PYMOD/vramguard/__init__.py (imported by path)"
    else
        echo "  python module missing: $PYMOD"
        rc=1
    fi
    for tool in nvidia-smi python3 setpriv unshare timeout tar; do
        command -v "$tool" >/dev/null 2>&1 && echo "  found: $tool" || echo "  not here: $tool"
    done
    [ -x "$BIN" ] && echo "  binary: $("$BIN" --version 2>&1 | head -1)" || echo "  binary not here: $BIN"
    exit "$rc"
fi

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu-check: nvidia-smi is missing: this is not a machine with an NVIDIA driver; refusing to run" >&2
    exit 2
fi
if [ ! -x "$BIN" ]; then
    echo "gpu-check: $BIN is not an executable vramguard binary" >&2
    exit 2
fi
BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")
if [ -d "$DIR" ] && [ -n "$(ls -A "$DIR" 2>/dev/null)" ]; then
    mv "$DIR" "$DIR.prev-$(date +%s)" || { echo "gpu-check: cannot move the old $DIR aside" >&2; exit 2; }
fi
mkdir -p "$DIR/snapshots" || exit 2
DIR=$(cd "$DIR" && pwd)
case "$DIR/" in
    "${OUT:-/nonexistent}"/*) echo "gpu-check: note: $DIR is inside \$OUT: every file in it would come back on its own; only the tarball should be there" >&2 ;;
esac
TMP=$(mktemp -d /tmp/gpu-check.XXXXXX) || exit 2
chmod 755 "$TMP"
# What /dev/shm held before: the semaphores the check's SIGKILLed launchers leave are removed
# at the end, and nothing that was there before.
SHM_BEFORE=$(ls -1A /dev/shm 2>/dev/null | LC_ALL=C sort)

log() { echo "[$(date +%T) +$(elapsed_s)s] $*" | tee -a "$DIR/check.log"; }

# --- processes: recorded by pid + start time, and tagged ---------------------------------
GPU_CHECK_TAG=gpu-check-$$-$RANDOM$RANDOM
export GPU_CHECK_TAG
export CUDA_DEVICE_ORDER=PCI_BUS_ID
export PYTHONUNBUFFERED=1
TRACKED=()
starttime() { # PID -> its start time (field 22 of /proc/PID/stat), or fail
    local s
    s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    s=${s##*) }
    local -a f
    read -ra f <<<"$s"
    echo "${f[19]}"
}
track() {
    local p st
    for p in "$@"; do
        [[ $p =~ ^[0-9]+$ ]] || continue
        st=$(starttime "$p") || continue
        TRACKED+=("$p:$st")
    done
}
state_of() { # PID -> its state letter (field 3 of /proc/PID/stat), or fail
    local s
    s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    s=${s##*) }
    echo "${s%% *}"
}
alive() { # PID: still the process we recorded, and not a zombie waiting for its reaper?
    local e
    for e in ${TRACKED[@]+"${TRACKED[@]}"}; do
        if [ "${e%%:*}" = "$1" ]; then
            [ "$(starttime "$1" 2>/dev/null)" = "${e#*:}" ] || continue
            case "$(state_of "$1")" in Z | X | "") return 1 ;; esac
            return 0
        fi
    done
    return 1
}
kill_pid() { # SIG PID...: only processes we recorded, and only if still the same process
    local sig=$1 p
    shift
    for p in "$@"; do alive "$p" && kill "-$sig" "$p" 2>/dev/null; done
    return 0
}
reap_tagged() { # kill (by pid) every process still carrying our tag; no subshells here
    local d p e found=0
    local -a envs
    for d in /proc/[0-9]*; do
        p=${d#/proc/}
        [ "$p" = "$$" ] && continue
        [ "$p" = "${BASHPID:-$$}" ] && continue
        mapfile -d "" -t envs 2>/dev/null <"$d/environ" || continue
        for e in ${envs[@]+"${envs[@]}"}; do
            if [ "$e" = "GPU_CHECK_TAG=$GPU_CHECK_TAG" ]; then
                found=$((found + 1))
                echo "[cleanup] left behind: pid $p ($(tr -d '\n' <"$d/comm" 2>/dev/null)): SIGKILL" >>"$DIR/check.log"
                kill -KILL "$p" 2>/dev/null
                break
            fi
        done
    done
    return "$((found > 0))"
}

remove_own_semaphores() { # sem.mp-* left by the check's killed multiprocessing launchers
    local f n=0
    for f in /dev/shm/sem.mp-*; do
        # A regular file of ours, new since the check began, at least 5 s old, that no
        # process maps. A live semaphore is mapped by its users from the moment sem_open
        # returns; the age leaves alone one another root job is creating right now (made,
        # not yet mapped). One that nobody has mapped for 5 s is of a process that is gone.
        [ -f "$f" ] && [ ! -L "$f" ] && [ -O "$f" ] || continue
        grep -qxF -- "${f#/dev/shm/}" <<<"$SHM_BEFORE" && continue
        local mtime
        mtime=$(stat -c %Y -- "$f" 2>/dev/null) || continue
        [ $(($(date +%s) - mtime)) -ge 5 ] || continue
        local users rc
        users=$(timeout 10 grep -lsF -- "$f" /proc/[0-9]*/maps)
        rc=$?
        [ "$rc" = 124 ] && continue # not known: kept
        [ -n "$users" ] && continue
        rm -f -- "$f" && n=$((n + 1))
    done
    [ "$n" -gt 0 ] && echo "[cleanup] removed $n semaphore(s) (sem.mp-*) the killed launchers left in /dev/shm" >>"$DIR/check.log"
    return 0
}

# --- packing: called by cleanup, after every process of the check is gone -------------------
pack() {
    local ms
    ms=$(($(now_ms) - T0))
    {
        echo "gpu-check $(date -u +%FT%TZ), $((ms / 1000)) s in all"
        echo "binary: $("$BIN" --version 2>&1 | head -2 | tr '\n' ' ')"
        echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader -i "$GPU" 2>&1)"
        echo
        echo "steps (name, seconds, budget):"
        cat "$DIR/timing.tsv" 2>/dev/null
        echo
        grep -E 'timing:|SKIP|survived|workers after|memory:|agent( after[^:]*)?:|alert sink|agent cost|oom|c1 |unprivileged|namespace|cleanup|interrupted|terminated' "$DIR/check.log" 2>/dev/null
    } >"$DIR/summary.txt"
    (cd "$(dirname "$DIR")" && tar -czf "$TARBALL" "$(basename "$DIR")") &&
        echo "gpu-check: results in $DIR, packed into $TARBALL ($(du -h "$TARBALL" | cut -f1)), $((ms / 1000)) s" ||
        echo "gpu-check: could not write $TARBALL (results are in $DIR)" >&2
}
CLEANED=0
cleanup() {
    [ "$CLEANED" = 1 ] && return
    CLEANED=1
    trap '' INT TERM
    local e
    # The agents first, politely (their exit is part of the record), then everything else.
    for e in ${AGENTS[@]+"${AGENTS[@]}"}; do kill_pid TERM "$e"; done
    sleep 0.3
    for e in ${TRACKED[@]+"${TRACKED[@]}"}; do kill_pid KILL "${e%%:*}"; done
    sleep 0.2
    reap_tagged || true
    sleep 0.2
    reap_tagged && echo "[cleanup] no process of the check is left" >>"$DIR/check.log"
    remove_own_semaphores
    rm -rf "$TMP"
    pack
}
trap cleanup EXIT
trap 'log "interrupted: cleaning up"; exit 130' INT
trap 'log "terminated: cleaning up"; exit 143' TERM

# --- steps --------------------------------------------------------------------------------
STEP=""
STEP_T=0
step() { # NAME: start it if its budget fits in what is left
    local b left
    b=$(budget_of "$1")
    left=$((BUDGET - $(elapsed_s)))
    if [ "$left" -lt "$b" ]; then
        log "SKIP $1: its budget is ${b}s, ${left}s left"
        printf '%s\tskipped\t%s\n' "$1" "$b" >>"$DIR/timing.tsv"
        return 1
    fi
    STEP=$1
    STEP_T=$(now_ms)
    log "== $1 (budget ${b}s, ${left}s left)"
    return 0
}
end_step() {
    local ms b
    ms=$(($(now_ms) - STEP_T))
    b=$(budget_of "$STEP")
    log "timing: $STEP took $((ms / 1000)).$(printf '%03d' $((ms % 1000)))s (budget ${b}s)$([ $((ms / 1000)) -ge "$b" ] && echo ' OVER BUDGET')"
    printf '%s\t%d.%03d\t%s\n' "$STEP" $((ms / 1000)) $((ms % 1000)) "$b" >>"$DIR/timing.tsv"
}

# save NAME LIMIT_S CMD...: stdout+stderr into $DIR/NAME, exit code and time into the log.
save() {
    local name=$1 limit=$2 t rc
    shift 2
    t=$(now_ms)
    timeout -k 2 "$limit" "$@" >"$DIR/$name" 2>&1
    rc=$?
    log "  $name: exit $rc in $(($(now_ms) - t)) ms"
    return "$rc"
}
# vg NAME LIMIT_S ARGS...: save the output of `vramguard ARGS`.
vg() {
    local name=$1 limit=$2
    shift 2
    save "$name" "$limit" "$BIN" "$@"
}
# snap FILE: `vramguard snapshot --sample 1s` into snapshots/FILE (stdout only: the corpus format).
snap() {
    local t rc
    t=$(now_ms)
    timeout -k 2 15 "$BIN" snapshot --sample 1s >"$DIR/snapshots/$1" 2>>"$DIR/check.log"
    rc=$?
    log "  snapshots/$1: exit $rc in $(($(now_ms) - t)) ms"
}
# wait_ready FILE LIMIT_S [PID]: wait for the helper's `ready PID...` line; its pids in READY.
# With PID (the helper or its wrapper), give up as soon as that process is gone.
READY=()
wait_ready() {
    local file=$1 limit=$2 watch=${3:-} line deadline
    deadline=$(($(now_ms) + limit * 1000))
    READY=()
    while [ "$(now_ms)" -lt "$deadline" ]; do
        if [ -f "$file" ]; then
            while read -r line; do
                if [[ $line == ready\ * ]]; then
                    read -ra READY <<<"${line#ready }"
                    track "${READY[@]}"
                    return 0
                fi
            done <"$file"
        fi
        if [ -n "$watch" ] && ! kill -0 "$watch" 2>/dev/null; then
            log "  $(basename "$file"): the helper exited without a ready line"
            return 1
        fi
        sleep 0.05
    done
    log "  no ready line in $(basename "$file") after ${limit}s"
    return 1
}
used_mib() { # the GPU's used memory per nvidia-smi, MiB
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "$GPU" 2>/dev/null | tr -d ' ' | head -1
}
smi_views() { # PREFIX: nvidia-smi and its process query, as the issue quotes them
    save "$1-nvidia-smi.txt" 10 nvidia-smi
    save "$1-compute-apps.csv" 10 nvidia-smi --query-compute-apps=pid,used_memory --format=csv
}
report_pids() { # WHAT PID...: which of them are alive now
    local what=$1 p out=""
    shift
    for p in "$@"; do
        if alive "$p"; then out+=" $p:alive"; else out+=" $p:gone"; fi
    done
    log "  $what:$out"
}
fetch() { # URL FILE
    timeout 6 python3 "$HELPERS/fetch.py" "$1" 5 >"$2" 2>>"$DIR/check.log"
}
metric_lines() { # FILE PATTERN [nonzero]: the matching sample lines, on one line, labels cut
    grep -E "$2" "$1" 2>/dev/null | grep -v '^#' | { if [ "${3:-}" = nonzero ]; then grep -v ' 0$'; else cat; fi; } |
        sed -E 's/,?(uuid|model)="[^"]*"//g; s/^vramguard_//' | tr '\n' ';' | cut -c1-600
}
sink_lines() { # the alert sink's lines so far, on one line
    if [ -f "$DIR/alerts.txt" ]; then tr '\n' ';' <"$DIR/alerts.txt" | cut -c1-600; else echo "(nothing delivered)"; fi
}
toml_str() {
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    printf '"%s"' "$s"
}
# start_agent NAME PORT CONFIG: the agent on loopback, --interval 500ms; its pid in AGENT.
AGENTS=()
AGENT=""
start_agent() {
    local i
    "$BIN" --config "$3" agent --listen "127.0.0.1:$2" --interval 500ms >"$DIR/$1.log" 2>&1 &
    AGENT=$!
    track "$AGENT"
    AGENTS+=("$AGENT")
    for i in $(seq 50); do
        fetch "http://127.0.0.1:$2/metrics" /dev/null 2>/dev/null && { log "  $1: pid $AGENT serving after ~$((i * 100)) ms"; return 0; }
        alive "$AGENT" || break
        sleep 0.1
    done
    log "  $1: not serving (see $1.log)"
    return 1
}
stop_agent() { # PID: TERM, wait up to 5 s
    local i
    kill_pid TERM "$1"
    for i in $(seq 50); do alive "$1" || break; sleep 0.1; done
    alive "$1" && { log "  agent $1 still alive 5 s after SIGTERM: SIGKILL"; kill_pid KILL "$1"; }
    wait "$1" 2>/dev/null
    log "  agent $1 exit: $?"
}
cpu_ticks() { # PID: utime+stime in clock ticks
    local s
    s=$(cat "/proc/$1/stat" 2>/dev/null) || { echo 0; return; }
    s=${s##*) }
    local -a f
    read -ra f <<<"$s"
    echo $((f[11] + f[12]))
}
cpu_ns() { # PID: CPU time of the whole process in ns, its exited threads included (the
    # process CPU clock, clock_gettime of ((~PID) << 3) | 2; the clock ticks of /proc/PID/stat
    # are 10 ms steps, coarser than a whole 20 s window of an agent at 0.5 ms a sample); from
    # every live thread's schedstat, then the ticks, where that clock cannot be read
    local ns f t rest s=0 any=0
    ns=$(python3 -c 'import sys, time; print(time.clock_gettime_ns(((~int(sys.argv[1])) << 3) | 2))' "$1" 2>/dev/null)
    if [[ $ns =~ ^[0-9]+$ ]]; then
        echo "$ns"
        return
    fi
    for f in /proc/"$1"/task/*/schedstat; do
        read -r t rest 2>/dev/null <"$f" || continue
        [[ $t =~ ^[0-9]+$ ]] || continue
        s=$((s + t))
        any=1
    done
    if [ "$any" = 1 ] && [ "$s" -gt 0 ]; then
        echo "$s"
    else
        echo $(($(cpu_ticks "$1") * 1000000000 / $(getconf CLK_TCK)))
    fi
}
us_per() { # NS COUNT: NS/COUNT in µs with 3 decimals, as "X.YYY"; "n/a" unless both > 0
    if [ "$1" -le 0 ] 2>/dev/null || [ "$2" -le 0 ] 2>/dev/null; then
        echo "n/a"
        return
    fi
    local n=$(($1 / $2))
    echo "$((n / 1000)).$(printf '%03d' $((n % 1000)))"
}
collections() { # METRICS_FILE: sum of vramguard_collections_total over kinds
    awk '/^vramguard_collections_total/ { s += $NF } END { printf "%d\n", s }' "$1" 2>/dev/null
}
# reclaim_timed NAME BELOW_MIB [ARG...]: reclaim --yes (with ARGs) while a watcher reads the
# GPU's used memory (NVML through pynvml every ~2 ms, else nvidia-smi); log how long until it
# is back. The watcher stops 3 s after reclaim ends (reclaim may rightly leave the memory
# alone).
reclaim_timed() {
    local name=$1 below=$2 watcher t rc i
    shift 2
    timeout -k 2 40 python3 "$HELPERS/memwatch.py" "$GPU" "$below" 35 "$DIR/$name-memory.csv" >"$DIR/$name-memwatch.txt" 2>&1 &
    watcher=$!
    track "$watcher"
    wait_ready "$DIR/$name-memwatch.txt" 10 "$watcher" || true
    t=$(now_ms)
    timeout -k 2 30 "$BIN" reclaim --yes --gpu "$GPU" --grace 5s --release-timeout 15s --reset never \
        --audit-log "$DIR/$name-audit.jsonl" "$@" >"$DIR/$name.txt" 2>&1
    rc=$?
    log "  $name: exit $rc in $(($(now_ms) - t)) ms"
    for i in $(seq 30); do alive "$watcher" || break; sleep 0.1; done
    kill_pid TERM "$watcher" ${READY[@]+"${READY[@]}"}
    wait "$watcher" 2>/dev/null
    log "  $name memory: $(grep -E '^(back|not back|reading)' "$DIR/$name-memwatch.txt" | tr '\n' ' ')"
    log "  $name says: $({ grep -iE 'expected back' "$DIR/$name.txt"; tail -n 3 "$DIR/$name.txt"; } | tr '\n' ' ' | cut -c1-500)"
    return 0
}

# =========================================================================================
log "gpu-check: binary $BIN ($("$BIN" --version 2>&1 | tr '\n' ' '))"
log "results in $DIR; tarball $TARBALL; GPU $GPU; budget ${BUDGET}s; tag $GPU_CHECK_TAG"

TORCH_OK=0
BASE_MIB=0
BUS=""
if step preflight; then
    # Warm the page cache for torch while nvidia-smi and vramguard run.
    timeout 60 python3 -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda)' \
        >"$DIR/env-torch.txt" 2>&1 &
    TORCHPROBE=$!
    track "$TORCHPROBE"
    { uname -a; id; cat /proc/version; echo "nproc $(nproc)"; } >"$DIR/env.txt" 2>&1
    "$BIN" --version >>"$DIR/env.txt" 2>&1
    save nvidia-smi-before.txt 10 nvidia-smi
    save nvidia-smi-q.txt 10 nvidia-smi -q -i "$GPU"
    BUS=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i "$GPU" | tr -d ' ')
    BASE_MIB=$(used_mib)
    log "  GPU $GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,persistence_mode --format=csv,noheader -i "$GPU"), bus $BUS"
    [ "${BASE_MIB:-0}" -gt 4096 ] 2>/dev/null && log "  WARNING: ${BASE_MIB} MiB already used before the check: results may mix in someone else's memory"
    # What an NVML client holds on this driver (uvm too, on 580?), the library it maps, and
    # whether nvmlShutdown lets go of the files (vramguard's resets rely on it).
    timeout 10 python3 "$HELPERS/nvml_files.py" >"$DIR/nvml-files.json" 2>&1
    log "  NVML client: $(cut -c1-400 "$DIR/nvml-files.json")"
    vg status-before.txt 15 status
    vg status-before.json 15 status --json
    vg diagnose-before.txt 15 diagnose
    wait "$TORCHPROBE"
    rc=$?
    if [ "$rc" = 0 ]; then TORCH_OK=1; fi
    log "  $(tr '\n' ' ' <"$DIR/env-torch.txt" | cut -c1-300) (exit $rc)"
    end_step
fi
BASE_MIB=${BASE_MIB:-0}
[[ $BASE_MIB =~ ^[0-9]+$ ]] || BASE_MIB=0
BELOW=$((BASE_MIB + 1024))
[ "$TORCH_OK" = 1 ] || log "PyTorch did not import: the PyTorch cases will fail (see env-torch.txt)"
cd "$HELPERS" || exit 2   # the helpers import common.py from here

# --- cases 1, 5, 6, 7 ----------------------------------------------------------------------
if step trainer; then
    # Case 6: an agent watching before the trainer starts (it sees the tree before the death).
    cat >"$TMP/alert-sink.sh" <<'EOF'
#!/bin/sh
# The alert sink of gpu-check: one line per notification, into the file named by $1.
printf '%s %s rule=%s gpu=%s value=%s %s\n' "$(date +%T.%N)" "$VRAMGUARD_ALERT_STATUS" \
    "$VRAMGUARD_ALERT_RULE" "$VRAMGUARD_ALERT_GPU" "$VRAMGUARD_ALERT_VALUE" "$VRAMGUARD_ALERT_SUMMARY" >>"$1"
EOF
    cat >"$TMP/agent-alert.toml" <<EOF
[agent]
listen = "127.0.0.1:$PORT"
interval = "500ms"
discover_every = "1s"
recheck_every = "1s"

[alerts]
log = true

[[alerts.rule]]
name = "ghost-memory"
when = "ghost_bytes"
above = "1GiB"
for = "1s"

[[alerts.exec]]
argv = ["/bin/sh", $(toml_str "$TMP/alert-sink.sh"), $(toml_str "$DIR/alerts.txt")]
timeout = "5s"
EOF
    cp "$TMP/agent-alert.toml" "$DIR/agent-alert.toml"
    start_agent agent-alert "$PORT" "$TMP/agent-alert.toml"
    ALERT_AGENT=$AGENT
    A0_NS=$(cpu_ns "$ALERT_AGENT")
    fetch "http://127.0.0.1:$PORT/metrics" "$TMP/a0.prom"
    A0_COLL=$(collections "$TMP/a0.prom")

    # Case 5, first half: the OOM script pays for `import torch` now, waits for the go file.
    timeout -k 2 150 env GPU_CHECK_GO="$TMP/go-oom" VRAMGUARD_BINARY="$BIN" CUDA_VISIBLE_DEVICES="$GPU" \
        python3 oom.py "$PYMOD" >"$DIR/oom.out" 2>"$DIR/oom.err" &
    OOM=$!
    track "$OOM"

    # Case 1: the trainer in its own session and process group (timeout stays outside it).
    timeout -k 2 -s KILL 120 setsid env CUDA_VISIBLE_DEVICES="$GPU" python3 train.py 20 2 90 \
        >"$DIR/train-own-job.out" 2>"$DIR/train-own-job.err" &
    WRAP=$!
    track "$WRAP"
    disown "$WRAP"
    if wait_ready "$DIR/train-own-job.out" 40 "$WRAP"; then
        TRAINER=${READY[0]}
        WORKERS=("${READY[@]:1}")
        log "  trainer $TRAINER (pgid $(ps -o pgid= -p "$TRAINER" | tr -d ' '), sid $(ps -o sid= -p "$TRAINER" | tr -d ' ')), workers ${WORKERS[*]}"
        save c1-compute-apps-alive.csv 10 nvidia-smi --query-compute-apps=pid,used_memory --format=csv
        sleep 2 # the agent samples the live tree (interval 500ms, discovery every 1s)
        kill_pid KILL "$TRAINER"
        KILLED_AT=$(now_ms)
        log "  SIGKILL trainer $TRAINER; used $(used_mib) MiB right after"
        sleep 3 # as in the fixture: 3 s after the kill
        smi_views c1
        snap dead-trainer-inherited-fds.json
        vg c1-status.txt 15 status
        vg c1-status.json 15 status --json
        vg c1-diagnose.txt 15 diagnose
        vg c1-metrics.prom 15 metrics
        log "  c1 metrics: $(metric_lines "$DIR/c1-metrics.prom" '^vramguard_gpu_ghost_bytes') $(metric_lines "$DIR/c1-metrics.prom" '^vramguard_gpu_memory_class_bytes' nonzero)"
        vg c1-top.txt 10 top --once
        log "  c1 status headline: $(grep -iE 'ghost|accounted|every byte' "$DIR/c1-status.txt" | head -3 | tr '\n' ' ' | cut -c1-400)"

        # Case 7: unprivileged, and from another PID namespace.
        cp "$BIN" "$TMP/vramguard" && chmod 755 "$TMP/vramguard"
        if command -v setpriv >/dev/null 2>&1; then
            (cd / && timeout -k 2 15 setpriv --reuid=65534 --regid=65534 --clear-groups \
                "$TMP/vramguard" snapshot --sample 1s) >"$DIR/snapshots/dead-trainer-seen-unprivileged.json" 2>>"$DIR/check.log"
            log "  unprivileged snapshot: exit $?"
            # shellcheck disable=SC2016 # $0 is expanded by that sh
            save c1-status-unprivileged.txt 15 sh -c 'cd / && exec setpriv --reuid=65534 --regid=65534 --clear-groups "$0" status' "$TMP/vramguard"
        else
            log "  setpriv not here: no unprivileged view"
        fi
        if command -v unshare >/dev/null 2>&1; then
            timeout -k 2 15 unshare --pid --fork --mount-proc "$BIN" snapshot --sample 1s \
                >"$DIR/snapshots/seen-from-another-pid-namespace.json" 2>>"$DIR/check.log"
            log "  other-PID-namespace snapshot: exit $?"
            save c1-status-pidns.txt 15 unshare --pid --fork --mount-proc "$BIN" status
        else
            log "  unshare not here: no other-namespace view"
        fi

        # Case 6: what the agent saw.
        fetch "http://127.0.0.1:$PORT/metrics" "$DIR/c1-agent-metrics.prom"
        fetch "http://127.0.0.1:$PORT/api/status" "$DIR/c1-agent-status.json"
        log "  agent: $(metric_lines "$DIR/c1-agent-metrics.prom" '^vramguard_(gpu_ghost_bytes|alert_firing)')"
        log "  alert sink: $(sink_lines)"
        A1_NS=$(cpu_ns "$ALERT_AGENT")
        A1_COLL=$(collections "$DIR/c1-agent-metrics.prom")

        # Case 5: the OOM, with the ghost still there.
        touch "$TMP/go-oom"
        for _ in $(seq 300); do alive "$OOM" || break; sleep 0.1; done
        wait "$OOM" 2>/dev/null
        log "  oom.py exit: $? (1 = the OutOfMemoryError was raised, uncaught)"
        log "  oom: $(grep -E '^(module|oom|explain)' "$DIR/oom.out" | tr '\n' ' ' | cut -c1-500)"
        log "  oom hook: $(grep '^vramguard' "$DIR/oom.err" | tr '\n' ' ' | cut -c1-400)"

        # Case 6 again, just before the reclaim (a longer time since the kill).
        fetch "http://127.0.0.1:$PORT/metrics" "$DIR/c1-agent-metrics-prereclaim.prom"
        log "  agent $((($(now_ms) - KILLED_AT) / 1000)) s after the kill: $(metric_lines "$DIR/c1-agent-metrics-prereclaim.prom" '^vramguard_(gpu_ghost_bytes|alert_firing)')"

        # Case 1: reclaim and the time until the memory is back.
        reclaim_timed c1-reclaim "$BELOW"
        log "  since the SIGKILL: $((($(now_ms) - KILLED_AT) / 1000)) s"
        report_pids "workers after reclaim" "${WORKERS[@]}"
        vg c1-status-after.txt 15 status
        kill_pid KILL "${WORKERS[@]}"
        # Until the agent says the ghost is gone and the sink has the resolution (10 s at most):
        # how long that takes is part of the record, and a busy machine must not cut it short.
        t=$(now_ms)
        settled="not resolved within 10 s"
        while [ "$(now_ms)" -lt $((t + 10000)) ]; do
            fetch "http://127.0.0.1:$PORT/metrics" "$DIR/c1-agent-metrics-after.prom" 2>/dev/null
            if grep -q "^vramguard_gpu_ghost_bytes{gpu=\"$GPU\"[,}].* 0\$" "$DIR/c1-agent-metrics-after.prom" 2>/dev/null &&
                grep -q " resolved rule=ghost-memory gpu=$GPU " "$DIR/alerts.txt" 2>/dev/null; then
                settled="resolved"
                break
            fi
            sleep 0.25
        done
        log "  agent after ($settled, $(($(now_ms) - t)) ms after the reclaim's end): $(metric_lines "$DIR/c1-agent-metrics-after.prom" '^vramguard_(gpu_ghost_bytes|alert_firing|collection_errors_total)')"
        log "  alert sink after: $(sink_lines)"
        if [ "${A1_COLL:-0}" -gt "${A0_COLL:-0}" ]; then
            log "  alert agent: $(us_per $((A1_NS - A0_NS)) $((A1_COLL - A0_COLL))) µs CPU per collection over $((A1_COLL - A0_COLL)) collections with the trainer and its ghost (the process CPU clock)"
        fi
    else
        kill_pid KILL "$OOM"
    fi
    alive "$OOM" && kill_pid KILL "$OOM"
    stop_agent "$ALERT_AGENT"
    grep -iE 'alert|firing|resolved' "$DIR/agent-alert.log" | head -5 | while read -r l; do log "  agent log: ${l:0:300}"; done
    end_step
fi

# --- case 2: the trainer in this script's process group ------------------------------------
if step in-script; then
    # No job control: the trainer shares this (still running) script's process group.
    timeout --foreground -k 2 -s KILL 90 env CUDA_VISIBLE_DEVICES="$GPU" python3 train.py 2.5 2 90 \
        >"$DIR/train-in-script.out" 2>"$DIR/train-in-script.err" &
    WRAP=$!
    track "$WRAP"
    disown "$WRAP"
    if wait_ready "$DIR/train-in-script.out" 25 "$WRAP"; then
        TRAINER=${READY[0]}
        WORKERS=("${READY[@]:1}")
        log "  trainer $TRAINER (pgid $(ps -o pgid= -p "$TRAINER" | tr -d ' '); this script: pgid $(ps -o pgid= -p $$ | tr -d ' ')), workers ${WORKERS[*]}"
        kill_pid KILL "$TRAINER"
        sleep 3
        smi_views c2
        snap dead-trainer-script-alive.json
        vg c2-status.txt 15 status
        vg c2-diagnose.txt 15 diagnose
        # Looked at after the kill, only elimination ties the workers to the dead trainer:
        # nothing by default, and the report's command (the script's job, keepers) frees it.
        vg c2-reclaim-default.txt 15 reclaim --dry-run --gpu "$GPU"
        log "  c2 default plan: $(grep -cE 'KILL +pid' "$DIR/c2-reclaim-default.txt") target(s); offered: $(grep -oE 'vramguard reclaim [^`]*--include keepers' "$DIR/c2-status.txt" "$DIR/c2-diagnose.txt" | head -1 | cut -d: -f2-)"
        reclaim_timed c2-reclaim "$BELOW" --job "pgid:$(ps -o pgid= -p $$ | tr -d ' ')" --include keepers
        report_pids "workers after reclaim" "${WORKERS[@]}"
        kill_pid KILL "${WORKERS[@]}"
    fi
    end_step
fi

# --- case 3: spawned workers of a killed launcher, the script alive ------------------------
if step spawned; then
    timeout --foreground -k 2 -s KILL 90 env CUDA_VISIBLE_DEVICES="$GPU" python3 spawn_workers.py 1 2 90 \
        >"$DIR/spawned.out" 2>"$DIR/spawned.err" &
    WRAP=$!
    track "$WRAP"
    disown "$WRAP"
    if wait_ready "$DIR/spawned.out" 30 "$WRAP"; then
        SPAWNED=("${READY[@]}")
        LAUNCHER=${SPAWNED[0]}
        WORKERS=("${SPAWNED[@]:1:2}")
        log "  launcher $LAUNCHER, workers ${WORKERS[*]}, others ${SPAWNED[*]:3}"
        kill_pid KILL "$LAUNCHER"
        sleep 3
        smi_views c3
        snap idle-spawned-workers-launcher-killed-script-alive.json
        vg c3-status.txt 15 status
        reclaim_timed c3-reclaim "$BELOW"
        report_pids "workers after reclaim" "${WORKERS[@]}"
        kill_pid KILL "${SPAWNED[@]:1}"
    fi
    end_step
fi

# --- case 4: a busy job whose launcher exited -----------------------------------------------
if step busy; then
    # shellcheck disable=SC2016 # $1..$3 are expanded by that bash
    setsid bash -c 'CUDA_VISIBLE_DEVICES="$3" python3 busy.py 60 >"$1" 2>"$2" & echo "$!" >"$4"; exit 0' _ \
        "$DIR/busy.out" "$DIR/busy.err" "$GPU" "$TMP/busy.pid" </dev/null
    if wait_ready "$DIR/busy.out" 25 "$(cat "$TMP/busy.pid" 2>/dev/null)"; then
        BUSY=${READY[0]}
        log "  busy job $BUSY (ppid $(ps -o ppid= -p "$BUSY" | tr -d ' '))"
        sleep 2
        vg c4-status.txt 15 status
        snap busy-job-launcher-exited.json
        vg c4-reclaim.txt 30 reclaim --yes --gpu "$GPU" --grace 5s --reset never --audit-log "$DIR/c4-reclaim-audit.jsonl"
        if alive "$BUSY"; then log "  busy job $BUSY survived reclaim --yes: yes"; else log "  busy job $BUSY survived reclaim --yes: NO (killed)"; fi
        kill_pid KILL "$BUSY"
    fi
    end_step
fi

# --- case 8: how long status takes next to nvidia-smi ---------------------------------------
if step timing; then
    TIMEFORMAT='%3R real %3U user %3S sys'
    {
        for what in "status" "status --sample 0s" "status --json" "status --full-scan" "nvidia-smi" "nvidia-smi --query-compute-apps=pid,used_memory --format=csv"; do
            for i in 1 2 3 4 5; do
                printf '%s\t%d\t' "$what" "$i"
                if [ "${what%% *}" = nvidia-smi ]; then
                    # shellcheck disable=SC2086 # the words of the command
                    { time $what >/dev/null 2>&1; } 2>&1
                else
                    # shellcheck disable=SC2086
                    { time "$BIN" $what >/dev/null 2>&1; } 2>&1
                fi
            done
        done
    } >"$DIR/timing.txt"
    unset TIMEFORMAT
    awk -F'\t' '{ split($3, a, " "); s[$1] = s[$1] " " int(a[1] * 1000) } END { for (k in s) print k ":" s[k] " ms" }' "$DIR/timing.txt" |
        while read -r l; do log "  $l"; done
    # Which path status took: the listed processes only (full_fd_scan false) or every process.
    vg timing-status.json 15 status --json
    log "  status full_fd_scan: $(grep -o '"full_fd_scan": *[a-z]*' "$DIR/timing-status.json" | head -1)"
    end_step
fi

# --- what each NVML call of a sample costs (where the agent's time goes on silicon) ---------
if step nvml-calls; then
    vg nvml-calls.txt 6 probe calls --gpu "$GPU" --samples 200 --timeout 5s
    vg nvml-calls.json 6 probe calls --gpu "$GPU" --samples 200 --timeout 5s --json
    head -8 "$DIR/nvml-calls.txt" | while read -r l; do log "  $l"; done
    end_step
fi

# --- case 9: the agent's cost with the real NVML --------------------------------------------
if step agent-cost; then
    : >"$TMP/agent-empty.toml"
    if start_agent agent-cost $((PORT + 1)) "$TMP/agent-empty.toml"; then
        COST_AGENT=$AGENT
        sleep 2
        fetch "http://127.0.0.1:$((PORT + 1))/metrics" "$DIR/agent-cost-metrics-0.prom"
        T_A=$(cpu_ticks "$COST_AGENT")
        N_A=$(cpu_ns "$COST_AGENT")
        C_A=$(collections "$DIR/agent-cost-metrics-0.prom")
        W_A=$(now_ms)
        sleep 20
        T_B=$(cpu_ticks "$COST_AGENT")
        N_B=$(cpu_ns "$COST_AGENT")
        alive "$COST_AGENT" || log "  agent-cost: the agent $COST_AGENT died during the window: no figure"
        W_B=$(now_ms)
        fetch "http://127.0.0.1:$((PORT + 1))/metrics" "$DIR/agent-cost-metrics-1.prom"
        C_B=$(collections "$DIR/agent-cost-metrics-1.prom")
        grep -E '^(VmRSS|VmHWM)' "/proc/$COST_AGENT/status" >"$DIR/agent-cost-rss.txt" 2>&1
        HZ=$(getconf CLK_TCK)
        N=$((C_B - C_A))
        CPU_MS=$(((T_B - T_A) * 1000 / HZ))
        {
            echo "window_ms $((W_B - W_A))"
            echo "collections $N (vramguard_collections_total, all kinds)"
            echo "cpu_ms_ticks $CPU_MS (utime+stime, ${HZ} ticks/s: a cross-check, 10 ms steps)"
            echo "cpu_ns $((N_B - N_A)) (the process CPU clock)"
            [ "$N" -gt 0 ] && echo "cpu_us_per_collection $(us_per $((N_B - N_A)) "$N")"
            echo "cpu_ms_per_s $(us_per $((N_B - N_A)) $((W_B - W_A)))"
            cat "$DIR/agent-cost-rss.txt"
        } >"$DIR/agent-cost.txt"
        log "  agent cost: $(tr '\n' ';' <"$DIR/agent-cost.txt")"
        log "  agent errors: $(metric_lines "$DIR/agent-cost-metrics-1.prom" '^vramguard_collection_errors_total')"
        stop_agent "$COST_AGENT"
    fi
    end_step
fi

# --- the release probe (trimmed) ------------------------------------------------------------
if step probe; then
    vg probe-release.txt 38 probe release --gpu "$GPU" --size 4GiB --signals TERM,KILL --repeat 3 \
        --timeout 15s --rate 1000 --report "$DIR/probe"
    log "  probe: $(grep -iE 'release|lag|Hz' "$DIR/probe-release.txt" | head -6 | tr '\n' ' ' | cut -c1-500)"
    end_step
fi

# --- vramguard run around a CUDA holder (the run summary, signal names) ----------------------
if step run; then
    if [ -n "$BUS" ]; then
        vg run.txt 12 run --summary-json "$DIR/run-summary.json" -- "$BIN" __cuda-hold --pci "$BUS" \
            --bytes $((4 << 30)) --lifetime 3
        log "  run: $(grep -iE 'killed|exit|released' "$DIR/run.txt" | head -3 | tr '\n' ' ' | cut -c1-300)"
    else
        log "  no PCI bus id (preflight skipped or failed): skipped"
    fi
    end_step
fi

# --- vramguard.guard() with real PyTorch -------------------------------------------------------
if step guard; then
    timeout -k 2 -s KILL 23 env VRAMGUARD_BINARY="$BIN" CUDA_VISIBLE_DEVICES="$GPU" \
        python3 guard.py "$PYMOD" 1 >"$DIR/guard.out" 2>"$DIR/guard.err"
    log "  guard.py exit: $?"
    log "  guard: $(grep -E 'SIGTERM sent|SIGKILL|exited|back after|still|gone:|took|cuda free' "$DIR/guard.out" | tr '\n' ' ' | cut -c1-900)"
    end_step
fi

# --- top against nvitop: what a user watching the GPU pays -----------------------------------
if step top-cost; then
    save top-cost.txt 14 python3 "$HELPERS/ptycost.py" 10 vramguard-top -- "$BIN" top --gpu "$GPU"
    if command -v nvitop >/dev/null 2>&1; then
        save top-cost-nvitop.txt 14 python3 "$HELPERS/ptycost.py" 10 nvitop -- \
            nvitop --monitor full --interval 1
    else
        echo "nvitop: not installed" >"$DIR/top-cost-nvitop.txt"
    fi
    log "  top cost: $(cat "$DIR/top-cost.txt" "$DIR/top-cost-nvitop.txt" | tr '\n' ' ' | cut -c1-400)"
    end_step
fi

log "after: used $(used_mib) MiB (before: $BASE_MIB MiB)"
vg status-after.txt 15 status
save nvidia-smi-after.txt 10 nvidia-smi

log "done in $(elapsed_s) s"
