#!/usr/bin/env bash
# Which NVML functions nvitop, gpustat and nvidia-ml-py look up on the simulated driver, and
# what the simulator does with each: prints the Markdown table of docs/simulator.md.
# Needs the clients' venv (scripts/test.sh builds target/pyenv) and a debug build.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q -p vramguard -p vramguard-sim-nvml
lib_dir=target/debug/sim-nvml
mkdir -p "$lib_dir"
ln -sf ../libvramguard_sim_nvml.so "$lib_dir/libnvidia-ml.so.1"
work=$(mktemp -d)
holder=
cleanup() { [ -n "$holder" ] && kill "$holder" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
[ -n "${KEEP:-}" ] && trap - EXIT
bin=target/debug/vramguard
"$bin" sim init --dir "$work/sim" >/dev/null
state=$work/sim/state.json
"$bin" --sim "$state" sim hold --gpu 0 --bytes 3GiB --sm-util 40 --lifetime 60s >/dev/null 2>&1 &
holder=$!
sleep 1
py=target/pyenv/bin
trace() { # tool args...
  VRAMGUARD_SIM=$state LD_LIBRARY_PATH=$lib_dir LD_DEBUG=symbols LD_DEBUG_OUTPUT="$work/trace.$1" \
    "$py/$@" >/dev/null 2>&1 || true
}
trace nvitop --once
trace gpustat --json
trace python -c '
import pynvml as n
n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
for f in (n.nvmlDeviceGetMemoryInfo, n.nvmlDeviceGetComputeRunningProcesses, n.nvmlDeviceGetUtilizationRates,
          n.nvmlDeviceGetCudaComputeCapability, n.nvmlDeviceGetMigMode, n.nvmlDeviceGetBAR1MemoryInfo,
          n.nvmlDeviceGetBrand, n.nvmlDeviceGetSerial, n.nvmlDeviceGetVbiosVersion, n.nvmlDeviceGetArchitecture,
          n.nvmlDeviceGetCurrPcieLinkGeneration, n.nvmlDeviceGetTotalEnergyConsumption):
    try: f(h)
    except n.NVMLError: pass
'
exported=$(nm -D --defined-only target/debug/libvramguard_sim_nvml.so | awk '{print $3}' | grep '^nvml' | sort)
# Answered NOT_SUPPORTED on purpose, as on an H100/H200 (SXM, Linux, confidential computing off).
not_supported="nvmlDeviceGetFanSpeed nvmlDeviceGetDriverModel nvmlDeviceGetDriverModel_v2 nvmlDeviceGetConfComputeMemSizeInfo"
echo "| NVML function | looked up by | simulator |"
echo "|---|---|---|"
for sym in $(cat "$work"/trace.* | grep -o 'symbol=nvml[A-Za-z_0-9]*' | sed 's/symbol=//' | sort -u); do
  who=$(for t in nvitop gpustat python; do
    if grep -q "symbol=$sym;" "$work/trace.$t".* 2>/dev/null; then echo -n "${t/python/nvidia-ml-py}, "; fi
  done)
  if grep -qx "$sym" <<<"$exported"; then
    if [[ " $not_supported " == *" $sym "* ]]; then status='`NOT_SUPPORTED`, as on an H100/H200'; else status=simulated; fi
  else
    status='not simulated (the client falls back)'
  fi
  echo "| \`$sym\` | ${who%, } | $status |"
done
