#!/usr/bin/env bash
# The whole test suite: builds every crate (the simulated libnvidia-ml.so.1 included) and runs
# every test. Installs the Debian packages the tests need when they are missing.
#
# The tests start real processes, PID namespaces (unshare) and cgroups, and read other
# processes' open files: they need root. Every process a test starts is killed by pid (or by
# the test's own cgroup) when the test ends.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "scripts/test.sh: the tests need root (PID namespaces, cgroups, other users' files); run it as root" >&2
    exit 2
fi

need=()
for tool in unshare setpriv mount; do
    command -v "$tool" >/dev/null 2>&1 || need+=(util-linux)
done
# The agent's tests run a real Prometheus (and promtool on the shipped rules) and render the
# status page in headless Chromium.
for tool in prometheus promtool; do
    command -v "$tool" >/dev/null 2>&1 || need+=(prometheus)
done
# Alerts reach a real Alertmanager's webhook receiver in one test.
command -v prometheus-alertmanager >/dev/null 2>&1 || need+=(prometheus-alertmanager)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
# The host-memory tests run small Python workers that map shared memory and lock pages.
[ -x /usr/bin/python3 ] || need+=(python3)
# The audit log's fsync before each signal is observed in the binary's system calls.
command -v strace >/dev/null 2>&1 || need+=(strace)
# The systemd unit in deploy/ is checked with systemd-analyze verify.
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
# A real single-node Slurm cluster (munged, slurmctld, slurmd) runs the epilog and the heal
# loop (crates/vramguard/tests/slurm.rs).
for tool in slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || need+=(slurm-wlm)
done
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need+=(munge)
if [ ${#need[@]} -gt 0 ]; then
    mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
    if command -v apt-get >/dev/null 2>&1; then
        echo "scripts/test.sh: installing ${need[*]}" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "scripts/test.sh: missing ${need[*]}; install them with your package manager" >&2
        exit 2
    fi
fi

# The simulated driver is judged by the clients users run against real ones: NVIDIA's Python
# bindings, nvitop and gpustat, in a venv inside the build folder (pinned versions).
pyenv=target/pyenv
clients="nvidia-ml-py==13.615.71 nvitop==1.7.2 gpustat==1.1.1"
if [ ! -f "$pyenv/.clients" ] || [ "$(cat "$pyenv/.clients")" != "$clients" ]; then
    command -v python3 >/dev/null 2>&1 || { echo "scripts/test.sh: python3 is missing" >&2; exit 2; }
    python3 -m venv "$pyenv" || {
        apt-get install -y -qq python3-venv >/dev/null && python3 -m venv "$pyenv"
    }
    # shellcheck disable=SC2086
    "$pyenv/bin/pip" install -q $clients
    echo "$clients" > "$pyenv/.clients"
fi

# nvidia-ml-py3, the old bindings that still call the unversioned symbols, in a venv of its own
# (it installs a `pynvml` module of the same name).
legacy=target/pyenv-legacy
legacy_clients="nvidia-ml-py3==7.352.0"
if [ ! -f "$legacy/.clients" ] || [ "$(cat "$legacy/.clients")" != "$legacy_clients" ]; then
    python3 -m venv "$legacy"
    "$legacy/bin/pip" install -q $legacy_clients
    echo "$legacy_clients" > "$legacy/.clients"
fi

cargo build --workspace --all-targets --locked
cargo test --workspace --locked

# Every benchmark once at a tiny size, unoptimised, so that none stops compiling or running
# (docs/testing.md); their timings are not judged.
scripts/bench.sh --tiny

# The release artifacts (scripts/package.sh) installed as an admin would: the .deb with dpkg,
# the .rpm into a scratch root, the wheel in a fresh venv, the tarball and the OCI image
# (crates/vramguard/tests/packaging.rs). VRAMGUARD_PACKAGING=quick (the default) builds them
# unoptimised, full as released, off skips them (and says so).
packaging=${VRAMGUARD_PACKAGING:-quick}
case "$packaging" in
    off)
        echo "scripts/test.sh: VRAMGUARD_PACKAGING=off: the packages and their install tests were skipped" >&2
        ;;
    quick|full)
        dist=target/package/dist
        rm -rf "$dist"
        if [ "$packaging" = quick ]; then
            scripts/package.sh --quick --out "$dist"
        else
            scripts/package.sh --out "$dist"
        fi
        # The install tests are #[ignore]d in a plain `cargo test` (no packages there): run
        # exactly them here. The .deb test would replace (and then purge) a vramguard already
        # installed on this machine: it is left out then, and the line below says so.
        skip=()
        if dpkg-query -W -f='${Status}' vramguard 2>/dev/null | grep -qv not-installed \
            || [ -e /usr/bin/vramguard ]; then
            echo "scripts/test.sh: vramguard is installed on this machine: the .deb install test was skipped" >&2
            skip=(--skip the_deb_installs_runs_verifies_and_is_removed_cleanly)
        fi
        VRAMGUARD_DIST="$PWD/$dist" cargo test --locked -p vramguard --test packaging -- --ignored "${skip[@]}"
        ;;
    *)
        echo "scripts/test.sh: VRAMGUARD_PACKAGING=$packaging: expected quick, full or off" >&2
        exit 2
        ;;
esac
