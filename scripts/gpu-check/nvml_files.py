"""What an NVML client holds of the driver, and whether nvmlShutdown lets go of it.

vramguard tells an NVML client (a monitor, an exporter, its own agent) from a CUDA context by
the library it maps (`libnvidia-ml` without `libcuda`), because driver 580's NVML holds
`/dev/nvidia-uvm` too; and before a GPU reset it shuts NVML down, because the driver refuses a
reset while another process holds the GPU. Both rest on facts this prints, as JSON, for this
driver: the device files and driver libraries of this process after nvmlInit_v2, and after
nvmlShutdown. Loads NVML with ctypes (VRAMGUARD_NVML_LIB, else libnvidia-ml.so.1); no CUDA.
"""

import ctypes
import json
import os


def device_files():
    held = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            target = os.readlink("/proc/self/fd/" + fd)
        except OSError:
            continue
        name = os.path.basename(target)
        if name.startswith("nvidia"):
            held.append(name)
    return sorted(set(held))


def libraries():
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.rstrip("\n").rsplit("/", 1)[-1]
            for lib in ("libcuda.so", "libnvidia-ml.so"):
                if "/" in line and name.startswith(lib):
                    found.add(lib)
    return sorted(found)


def main():
    lib = os.environ.get("VRAMGUARD_NVML_LIB") or "libnvidia-ml.so.1"
    out = {"library": lib, "before_init": {"files": device_files(), "libraries": libraries()}}
    nvml = ctypes.CDLL(lib)
    out["nvmlInit_v2"] = nvml.nvmlInit_v2()
    count = ctypes.c_uint(0)
    out["nvmlDeviceGetCount_v2"] = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
    out["gpus"] = count.value
    handle = ctypes.c_void_p()
    out["nvmlDeviceGetHandleByIndex_v2"] = nvml.nvmlDeviceGetHandleByIndex_v2(
        0, ctypes.byref(handle))
    out["after_init"] = {"files": device_files(), "libraries": libraries()}
    out["nvmlShutdown"] = nvml.nvmlShutdown()
    out["after_shutdown"] = {"files": device_files(), "libraries": libraries()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
