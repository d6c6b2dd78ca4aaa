#!/usr/bin/env bash
# Mutation testing (issue #27): cargo-mutants over the files that decide which processes are
# safe to signal and that act on that decision. Not part of scripts/test.sh or CI: a full run
# takes hours on a 2-core VM (see docs/testing.md, "Mutation testing").
#
#   scripts/mutants.sh                    # all six files
#   scripts/mutants.sh plan classify      # a subset, by short name or path
#   scripts/mutants.sh plan -- --re refusal --shard 1/2   # extra cargo-mutants arguments
#
# Each file is checked against the tests of its own crate only (unit tests and that crate's
# tests/ directory): cargo-mutants tests the mutated package (for the two vramguard-node
# files also vramguard-ops, which holds their tests; see the table below). The workspace's
# integration tests (crates/vramguard/tests, real processes and the binary) are far too slow per mutant,
# so a mutant they alone would catch is reported as missed here.
#
# Results: target/mutants/<short name>/mutants.out/ (caught.txt, missed.txt, timeout.txt,
# unviable.txt, outcomes.json). Needs `cargo install cargo-mutants --locked` (tested with 27.1).
#
# Environment: MUTANTS_JOBS (default 1), MUTANTS_TIMEOUT (seconds per test run, default 180),
# MUTANTS_BUILD_TIMEOUT (seconds per build, default 600), MUTANTS_TARGET_DIR (where the
# scratch copy builds, default target/mutants-build).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

# short name, file, its package, the packages whose tests check it (comma-separated). The
# node's pidfd identity and MachineNode's pin/signal are tested through vramguard-ops
# (crates/vramguard-ops/tests/identity.rs, real processes in a fresh PID namespace), so those
# two files are checked against the tests of vramguard-node and vramguard-ops.
table=(
    "plan crates/vramguard-core/src/plan.rs vramguard-core vramguard-core"
    "classify crates/vramguard-core/src/classify.rs vramguard-core vramguard-core"
    "reclaim crates/vramguard-ops/src/reclaim.rs vramguard-ops vramguard-ops"
    "audit crates/vramguard-ops/src/audit.rs vramguard-ops vramguard-ops"
    "identity crates/vramguard-node/src/identity.rs vramguard-node vramguard-node,vramguard-ops"
    "machine crates/vramguard-node/src/machine.rs vramguard-node vramguard-node,vramguard-ops"
)

want=()
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) want+=("$1"); shift ;;
    esac
done

if ! cargo mutants --version >/dev/null 2>&1; then
    echo "mutants.sh: cargo-mutants is not installed (cargo install cargo-mutants --locked)" >&2
    exit 2
fi

selected=()
if [ ${#want[@]} -eq 0 ]; then
    selected=("${table[@]}")
else
    for w in "${want[@]}"; do
        found=""
        for row in "${table[@]}"; do
            read -r name file _ <<<"$row"
            if [ "$w" = "$name" ] || [ "$w" = "$file" ]; then
                selected+=("$row")
                found=1
            fi
        done
        if [ -z "$found" ]; then
            echo "mutants.sh: unknown file '$w' (one of: plan classify reclaim audit identity machine)" >&2
            exit 2
        fi
    done
fi

# The scratch copy leaves target/ behind (it is git-ignored; copying it would mean 13 GB per
# run) and builds in a target directory of its own, kept between runs so that dependencies
# are compiled once: sharing the tree's target/ would let a later `cargo test` in the tree
# take a mutated build for a fresh one (the fingerprints ignore where the crate was copied).
export CARGO_TARGET_DIR="${MUTANTS_TARGET_DIR:-$root/target/mutants-build}"

status=0
for row in "${selected[@]}"; do
    read -r name file package tests <<<"$row"
    out="$root/target/mutants/$name"
    mkdir -p "$out"
    echo "== $name: $file against the tests of $tests"
    # `--test-package` alone did not reach `cargo test` in cargo-mutants 27.1 (it tested the
    # mutated package only), so the other packages are named to `cargo test` directly.
    test_args=()
    IFS=, read -r -a test_pkgs <<<"$tests"
    for t in "${test_pkgs[@]}"; do
        [ "$t" = "$package" ] || test_args+=("--cargo-test-arg=--package=$t")
    done
    nice -n "${MUTANTS_NICE:-15}" cargo mutants \
        --file "$file" \
        --workspace \
        "${test_args[@]}" \
        --copy-target false \
        --jobs "${MUTANTS_JOBS:-1}" \
        --timeout "${MUTANTS_TIMEOUT:-180}" \
        --build-timeout "${MUTANTS_BUILD_TIMEOUT:-600}" \
        --output "$out" \
        ${extra[@]+"${extra[@]}"} || status=$?
    # cargo-mutants exits 2 when a mutant was missed, 3 on a timeout: report and go on.
done
exit "$status"
