#!/usr/bin/env bash
# Rewrites the golden outputs of the incident corpus (tests/incidents/<name>/) from the current
# code. Run it after an intended change in wording or classification, review the diff, and
# commit it on its own, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
VRAMGUARD_UPDATE_GOLDEN=1 cargo test -p vramguard --test incidents -- every_incident_replays_to_its_golden_outputs
# The screens of `vramguard top` drawn from the demo incident (tests/screens/).
VRAMGUARD_UPDATE_GOLDEN=1 cargo test -p vramguard --bin vramguard -- top::view::tests
git status --short tests/incidents tests/screens || true
