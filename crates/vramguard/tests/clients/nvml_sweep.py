"""Calls every device and system query NVIDIA's Python bindings offer, on GPU 0, and prints
one JSON object: function name -> "ok", an NVML error name, or the Python error it raised.

Arguments past the device handle are zeros (the first clock type, sensor, link, P-state...).
Functions whose wrappers need something other than a handle and small integers (buffers,
structs, other handle types) are reported as "skipped: <why>".
"""
import inspect
import json
import sys

import pynvml as n

PREFIXES = ("nvmlDeviceGet", "nvmlSystemGet")
# Wrappers that take a struct or a caller's buffer, or that have side effects: named, not called.
SKIP = {
    "nvmlDeviceGetFieldValues": "takes a list of field ids (called separately)",
    "nvmlDeviceGetHandleByPciBusId_v2": "takes a bus id string (called separately)",
    "nvmlDeviceGetHandleBySerial": "takes a serial string (called separately)",
    "nvmlDeviceGetHandleByUUIDV": "takes a UUID and its type (called separately)",
}


def main():
    n.nvmlInit()
    handle = n.nvmlDeviceGetHandleByIndex(0)
    results = {}
    for name in sorted(dir(n)):
        if not name.startswith(PREFIXES):
            continue
        fn = getattr(n, name)
        if not callable(fn):
            continue
        if name in SKIP:
            results[name] = "skipped: " + SKIP[name]
            continue
        try:
            params = [
                p
                for p in inspect.signature(fn).parameters.values()
                if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            results[name] = "skipped: no signature"
            continue
        args = [0] * len(params)
        if name.startswith("nvmlDevice") and args:
            args[0] = handle
        results[name] = call(fn, args)
    # The ones that need other arguments, called with sensible ones.
    pci = n.nvmlDeviceGetPciInfo_v3(handle).busId
    results["nvmlDeviceGetHandleByPciBusId_v2"] = call(n.nvmlDeviceGetHandleByPciBusId, [pci])
    results["nvmlDeviceGetHandleBySerial"] = call(
        n.nvmlDeviceGetHandleBySerial, [n.nvmlDeviceGetSerial(handle)]
    )
    results["nvmlDeviceGetFieldValues"] = call(
        n.nvmlDeviceGetFieldValues, [handle, [n.NVML_FI_DEV_MEMORY_TEMP, n.NVML_FI_DEV_POWER_INSTANT]]
    )
    results["nvmlDeviceGetHandleByIndex"] = call(n.nvmlDeviceGetHandleByIndex, [0])
    results["nvmlDeviceGetHandleByUUID"] = call(
        n.nvmlDeviceGetHandleByUUID, [n.nvmlDeviceGetUUID(handle)]
    )
    results["nvmlDeviceGetHandleByPciBusId"] = results["nvmlDeviceGetHandleByPciBusId_v2"]
    results["nvmlDeviceGetHandleByUUIDV"] = call(
        n.nvmlDeviceGetHandleByUUIDV, [n.nvmlDeviceGetUUID(handle), n.NVML_UUID_TYPE_ASCII]
    )

    # Queries whose zero arguments above are not valid ones, again with valid ones.
    second = n.nvmlDeviceGetHandleByIndex(1)
    mem_clock = n.nvmlDeviceGetSupportedMemoryClocks(handle)[0]
    valid = {
        "nvmlDeviceGetCpuAffinity": [handle, 4],
        "nvmlDeviceGetCpuAffinityWithinScope": [handle, 4, 0],
        "nvmlDeviceGetMemoryAffinity": [handle, 4, 0],
        "nvmlDeviceGetP2PStatus": [handle, second, 0],
        "nvmlDeviceGetTopologyCommonAncestor": [handle, second],
        "nvmlDeviceGetSupportedGraphicsClocks": [handle, mem_clock],
        "nvmlDeviceGetRunningProcessDetailList": [handle, n.nvmlProcessDetailList_v1, 0],
        "nvmlDeviceGetConfComputeGpuAttestationReport": [handle, [0] * 32],
    }
    for name, args in valid.items():
        results[name] = call(getattr(n, name), args)
    for name, struct, version in [
        ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t", None),
        ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v2_t", "nvmlGpuFabricInfo_v2"),
        ("nvmlDeviceGetPciInfoExt", "nvmlPciInfoExt_v1_t", "nvmlPciInfoExt_v1"),
        ("nvmlDeviceGetNvLinkInfo", "c_nvmlNvLinkInfo_v2_t", "NVML_NVLINK_INFO_VER"),
    ]:
        if not hasattr(n, struct):
            results[name] = "skipped: no %s in these bindings" % struct
            continue
        value = getattr(n, struct)()
        if version is not None and hasattr(n, version):
            value.version = getattr(n, version)
        results[name] = call(getattr(n, name), [handle, n.byref(value)])
    n.nvmlShutdown()
    json.dump(results, sys.stdout, indent=1, sort_keys=True)


def call(fn, args):
    try:
        fn(*args)
        return "ok"
    except n.NVMLError as e:
        return type(e).__name__
    except Exception as e:  # a wrapper's own failure on what the library returned
        return "python: %s: %s" % (type(e).__name__, e)


main()
