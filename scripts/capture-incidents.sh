#!/usr/bin/env bash
# Re-stages the incidents of the corpus with real processes on the simulated driver and saves
# their snapshots into tests/incidents/ (existing files are kept: delete one to re-capture it),
# then regenerates the golden outputs. Needs root (cgroups, namespaces), like the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
export VRAMGUARD_CAPTURE_INCIDENTS="$PWD/tests/incidents/.captured"
rm -rf "$VRAMGUARD_CAPTURE_INCIDENTS"
cargo test -p vramguard --test launch_patterns --test classes -- --test-threads 2
cargo test -p vramguard --test incidents -- --ignored stage_incidents_for_the_corpus
for f in "$VRAMGUARD_CAPTURE_INCIDENTS"/*.json; do
    dest="tests/incidents/$(basename "$f")"
    [ -e "$dest" ] || cp "$f" "$dest"
done
rm -rf "$VRAMGUARD_CAPTURE_INCIDENTS"
exec scripts/update-golden.sh
