#!/usr/bin/env bash
# The benchmarks (every [[bench]] of the workspace), and each figure beside its README target.
#
#   scripts/bench.sh                 every benchmark at full size (optimised; ~7 minutes)
#   scripts/bench.sh agent top       only these benchmarks
#   scripts/bench.sh --soak agent    with the agent's one-hour soak (SOAK_SECS=3600)
#   scripts/bench.sh --tiny          every benchmark once at a tiny size, unoptimised: the
#                                    suite's check that none stopped compiling or running
#
# Each benchmark keeps its human output and prints each figure the README quotes as
# `BENCH <name> <value> <unit>` (or `BENCH-SKIP <name> <why>` when a run cannot measure it).
# The targets, and the README's words for each, are in docs/bench-targets.tsv (the README is
# checked against it by crates/vramguard/tests/readme.rs). A figure's name starts with its
# benchmark's name.
#
# Exit status: 0 when every benchmark ran and printed every figure it owes; 1 when one failed,
# printed a figure the targets file does not know, or left one out without saying why; 2 for
# a bad argument. Missed targets are reported, never a failure: timings on a shared machine
# are not a verdict. At full size the figures are worth comparing only on an idle machine.
#
# Needs root (the benchmarks start thousands of processes and read their fds). Installs the
# Debian packages the comparisons need when missing (fuser, lsof, Prometheus), as
# scripts/test.sh does, and says so; without apt-get it says which comparison it skips.
set -euo pipefail
cd "$(dirname "$0")/.."

size=full
soak=0
only=()
for arg in "$@"; do
    case "$arg" in
        --tiny) size=tiny ;;
        --soak) soak=1 ;;
        -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "scripts/bench.sh: unknown option $arg" >&2; exit 2 ;;
        *) only+=("$arg") ;;
    esac
done
targets=docs/bench-targets.tsv

if [ "$(id -u)" != 0 ]; then
    echo "scripts/bench.sh: the benchmarks need root (other processes' fds, PID namespaces); run it as root" >&2
    exit 2
fi

# Every [[bench]] of the workspace, as "package bench".
mapfile -t benches < <(cargo metadata --no-deps --format-version 1 --locked | python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    for t in p["targets"]:
        if "bench" in t["kind"]:
            print(p["name"], t["name"])
' | sort -k2)
if [ ${#only[@]} -gt 0 ]; then
    picked=()
    for want in "${only[@]}"; do
        found=
        for b in "${benches[@]}"; do
            [ "${b#* }" = "$want" ] && { picked+=("$b"); found=1; }
        done
        [ -n "$found" ] || { echo "scripts/bench.sh: no benchmark named $want (there are: ${benches[*]#* })" >&2; exit 2; }
    done
    benches=("${picked[@]}")
fi

# The comparisons' tools, installed as scripts/test.sh installs its packages.
need=()
command -v fuser >/dev/null 2>&1 || need+=(psmisc)
command -v lsof >/dev/null 2>&1 || need+=(lsof)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
if [ ${#need[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1; then
        echo "scripts/bench.sh: installing ${need[*]}" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        for p in "${need[@]}"; do
            case "$p" in
                psmisc) echo "scripts/bench.sh: fuser is missing (Debian package psmisc): the scan benchmark skips its fuser comparison" >&2 ;;
                lsof) echo "scripts/bench.sh: lsof is missing: the scan benchmark skips its lsof comparison" >&2 ;;
                prometheus) echo "scripts/bench.sh: prometheus is missing: the fleet benchmark cannot run" >&2 ;;
            esac
        done
    fi
fi
if [ ! -x target/pyenv/bin/nvitop ]; then
    echo "scripts/bench.sh: target/pyenv/bin/nvitop is missing (scripts/test.sh installs it): the top benchmark skips its nvitop comparison" >&2
fi

export VRAMGUARD_BENCH_SIZE=$size
if [ "$soak" = 1 ]; then
    export SOAK_SECS=${SOAK_SECS:-3600}
fi
out=$(mktemp -d "${TMPDIR:-/tmp}/vramguard-bench.XXXXXX")
trap 'rm -rf "$out"' EXIT

failed=()
start=$SECONDS
for b in "${benches[@]}"; do
    pkg=${b% *}
    name=${b#* }
    echo "== $name ($pkg), $size size" >&2
    t=$SECONDS
    if [ "$size" = tiny ]; then
        # The test profile and the workspace's features: what `cargo build --workspace
        # --all-targets` already built (-p would resolve features anew and rebuild).
        cmd=(cargo test --locked -q --workspace --bench "$name")
    else
        cmd=(cargo bench --locked -q --workspace --bench "$name")
    fi
    if "${cmd[@]}" 2>&1 | tee "$out/$name.log"; then
        echo "== $name: $((SECONDS - t)) s" >&2
    else
        echo "== $name: FAILED after $((SECONDS - t)) s" >&2
        failed+=("$name")
    fi
done
ran=$(printf '%s\n' "${benches[@]#* }")

# Each target beside its figure. A benchmark's figures are owed only when it ran.
cat "$out"/*.log 2>/dev/null | grep -E '^BENCH(-SKIP)? ' > "$out/figures" || true
echo
set +e
awk -F'\t' -v size="$size" -v ran="$ran" '
    BEGIN { n = split(ran, r, "\n"); for (i = 1; i <= n; i++) if (r[i] != "") benched[r[i]] = 1 }
    FILENAME != ARGV[1] && /^#/ { next }
    FILENAME != ARGV[1] && NF > 0 {
        known[$1] = 1; order[++rows] = $1; unit[$1] = $2; cmp[$1] = $3; target[$1] = $4; quote[$1] = $5
        next
    }
    FILENAME == ARGV[1] {
        split($0, f, " ")
        if (f[1] == "BENCH") { value[f[2]] = f[3]; vunit[f[2]] = f[4]; seen[f[2]] = 1 }
        else { why = $0; sub(/^BENCH-SKIP [^ ]+ /, "", why); skip[f[2]] = why; seen[f[2]] = 1 }
        if (!(f[2] in printed)) { printed[f[2]] = 1; plist[++np] = f[2] }
        next
    }
    function decimals(s) { return index(s, ".") ? length(s) - index(s, ".") : 0 }
    function judge(v, c, t,   d) {
        if (v != v + 0 || tolower(v) ~ /nan|inf/) return "not measured (" v ")"
        if (c == "ref") return "reference"
        if (c == "<") return v < t + 0 ? "met" : "MISSED"
        if (c == "<=") return v <= t + 0 ? "met" : "MISSED"
        if (c == ">") return v > t + 0 ? "met" : "MISSED"
        if (c == ">=") return v >= t + 0 ? "met" : "MISSED"
        if (c == "=") { d = decimals(t); return sprintf("%.*f", d, v) == sprintf("%.*f", d, t) ? "met" : "MISSED" }
        return "bad comparison " c
    }
    END {
        bad = 0; met = 0; missed = 0; skipped = 0
        for (i = 1; i <= np; i++) if (!(plist[i] in known)) {
            printf "scripts/bench.sh: a benchmark printed %s, which %s does not list\n", plist[i], ARGV[2] > "/dev/stderr"; bad = 1
        }
        printf "%-36s %16s  %-22s %s\n", "figure", "measured", "target", (size == "tiny" ? "(tiny size: not judged)" : "verdict")
        for (i = 1; i <= rows; i++) {
            k = order[i]; bench = k; sub(/\..*/, "", bench)
            if (!(bench in benched)) continue
            t = (cmp[k] == "ref" ? "README " : cmp[k] " ") target[k] " " unit[k]
            if (!(k in seen)) {
                printf "%-36s %16s  %-22s %s\n", k, "-", t, "NOT PRINTED by the " bench " benchmark"; bad = 1; continue
            }
            if (k in skip) { printf "%-36s %16s  %-22s skipped: %s\n", k, "-", t, skip[k]; skipped++; continue }
            if (vunit[k] != unit[k]) { printf "%-36s %16s  %-22s unit %s, expected %s\n", k, value[k], t, vunit[k], unit[k]; bad = 1; continue }
            v = sprintf("%.3g", value[k] + 0); if (value[k] + 0 >= 1000) v = sprintf("%.0f", value[k])
            if (size == "tiny") {
                # Timings are not judged here, but a figure that is not a number was not measured.
                if (value[k] != value[k] + 0 || tolower(value[k]) ~ /nan|inf/) { printf "%-36s %16s  %-22s NOT MEASURED\n", k, value[k], t; bad = 1; continue }
                printf "%-36s %16s  %-22s\n", k, v " " unit[k], t; continue
            }
            verdict = judge(value[k], cmp[k], target[k])
            if (verdict == "met") met++; else if (verdict == "MISSED") missed++
            printf "%-36s %16s  %-22s %s   (README: %s)\n", k, v " " unit[k], t, verdict, quote[k]
        }
        if (size != "tiny") printf "\n%d met, %d missed, %d skipped\n", met, missed, skipped
        exit bad
    }
' "$out/figures" "$targets"
consistent=$?
set -e

echo
echo "scripts/bench.sh: ${#benches[@]} benchmarks at $size size in $((SECONDS - start)) s" >&2
if [ ${#failed[@]} -gt 0 ]; then
    echo "scripts/bench.sh: FAILED: ${failed[*]}" >&2
    exit 1
fi
if [ "$consistent" != 0 ]; then
    echo "scripts/bench.sh: the figures printed and $targets disagree (see above)" >&2
    exit 1
fi
