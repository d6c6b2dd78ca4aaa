"""vramguard from Python: who holds a GPU's memory, why, and the command that frees it.

    import vramguard

    report = vramguard.status()        # `vramguard status --json`, parsed
    result = vramguard.diagnose()      # `vramguard diagnose --json`, parsed
    vramguard.explain_oom()            # opt in: explain CUDA out-of-memory errors

After `explain_oom()`, an uncaught `torch.cuda.OutOfMemoryError` prints, under the usual
traceback, who holds the GPU's memory and what frees it, for example::

    vramguard: 18.0 GiB on GPU 0 is held by 3 orphans of job pgid:13622: vramguard reclaim --gpu 0

In a notebook or a `try` block, `vramguard.explain(error)` returns the same text.

Every function runs the `vramguard` binary installed with this package (or the one named by
`VRAMGUARD_BINARY`, else the first on PATH). Without root it sees less: other users'
processes by pid only (the report's `limitations` say what is missing).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

__all__ = [
    "VramguardError",
    "binary",
    "diagnose",
    "explain",
    "explain_oom",
    "status",
]

#: How long one call of the binary may take: the default sampling window is 2 s.
TIMEOUT_SECS = 60.0


class VramguardError(RuntimeError):
    """The vramguard binary could not be run, or printed no JSON (its message says why)."""


def binary():
    """The path of the vramguard binary these functions run."""
    named = os.environ.get("VRAMGUARD_BINARY")
    if named:
        return named
    # The script installed with this module first: pip puts it beside the interpreter's.
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        if folder:
            candidate = os.path.join(folder, "vramguard")
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which("vramguard")
    if found:
        return found
    raise VramguardError(
        "the vramguard binary is neither installed beside this module nor on PATH; "
        "reinstall it with `pip install --force-reinstall vramguard`"
    )


def _duration(value):
    if isinstance(value, (int, float)):
        return "%gms" % (float(value) * 1000.0)
    return str(value)


def _run_json(command, gpus, sample, timeout):
    argv = [binary(), command, "--json"]
    if gpus is not None:
        if isinstance(gpus, (int, str)):
            gpus = [gpus]
        argv += ["--gpu", ",".join(str(g) for g in gpus)]
    if sample is not None:
        argv += ["--sample", _duration(sample)]
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            timeout=timeout,
            check=False,
        )
    except OSError as e:
        raise VramguardError("could not run %s: %s" % (argv[0], e)) from e
    except subprocess.TimeoutExpired as e:
        raise VramguardError(
            "`vramguard %s` gave no answer within %g s" % (command, timeout)
        ) from e
    # `status` exits 2 when a GPU could not be read and `diagnose` 1 when the node is not
    # clean: both still print their document. No document means it failed.
    out = done.stdout.decode("utf-8", "replace").strip()
    if not out:
        message = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise VramguardError(
            message[-1] if message else "vramguard exited %d" % done.returncode
        )
    try:
        return json.loads(out)
    except ValueError as e:
        raise VramguardError("`vramguard %s --json` printed no JSON: %s" % (command, e)) from e


def status(gpus=None, sample=None, timeout=TIMEOUT_SECS):
    """`vramguard status --json` as a dict: every GPU, every holder with its class and job.

    `gpus`: an index, a UUID or a list of them (default: all). `sample`: the sampling
    window, in seconds or as vramguard writes it ("2s").
    """
    return _run_json("status", gpus, sample, timeout)


def diagnose(gpus=None, sample=None, timeout=TIMEOUT_SECS):
    """`vramguard diagnose --json` as a dict: `checks`, `verdict` (with `next_steps`) and
    `report` (what `status()` returns)."""
    return _run_json("diagnose", gpus, sample, timeout)


def _visible(text, limit=80):
    """Text from the report as it may be printed: other users choose command names, command
    lines and cgroup names, so control characters (C0, DEL, C1) become visible escapes, as
    vramguard's own output shows them, and the text is cut to `limit` characters."""
    out = []
    for ch in str(text):
        code = ord(ch)
        if ch == "\x1b":
            out.append("\\e")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0:
            out.append("\\x%02x" % code)
        else:
            out.append(ch)
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _size(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return "%.1f %s" % (n / scale, unit)
    return "%d B" % n


def _is_cuda_oom(error):
    """Whether `error`, or an error it was raised from, is CUDA running out of memory."""
    torch = sys.modules.get("torch")
    oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if oom_type is not None and isinstance(error, oom_type):
            return True
        # Older PyTorch raised a plain RuntimeError.
        if isinstance(error, RuntimeError) and "CUDA out of memory" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _gpu_of(error, gpus):
    """The NVML index of the GPU an OOM message names ("GPU 0 has a total capacity…",
    "(GPU 0; 79.15 GiB total capacity…"), through CUDA_VISIBLE_DEVICES; None if unknown."""
    found = re.search(r"GPU (\d+)", str(error))
    if not found:
        return None
    ordinal = int(found.group(1))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return ordinal
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if ordinal >= len(entries):
        return None
    entry = entries[ordinal]
    if entry.isdigit():
        return int(entry)
    for g in gpus:
        uuid = g.get("uuid") or ""
        if uuid and (uuid == entry or uuid.startswith(entry) or ("GPU-" + entry) == uuid):
            return g["index"]
    return None


def _holder_phrase(holders):
    classes = sorted({h["class"] for h in holders})
    noun = {
        "orphan": "orphan",
        "zombie": "zombie",
        "hidden": "hidden holder",
        "idle": "idle holder",
    }.get(classes[0], "process") if len(classes) == 1 else "process"
    plural = "es" if noun.endswith("s") else "s"
    word = noun if len(holders) == 1 else noun + plural
    # One job per dead leader (or cgroup label), compared as the report gives it, escaped
    # only to be shown.
    jobs = []
    for h in holders:
        dead = h.get("dead_job") or {}
        job = (h.get("job") or {}).get("label") or dead.get("label") or dead.get("leader_pid")
        if job is not None and str(job) not in jobs:
            jobs.append(str(job))
    kept = sorted({h["keeps_alive"] for h in holders if h.get("keeps_alive") is not None})
    keeping = ""
    if kept:
        keeping = " keeping the context of exited pid %s" % ", ".join(str(k) for k in kept)
    if len(jobs) == 1:
        return "%d %s%s of job %s" % (len(holders), word, keeping, _visible(jobs[0], 60))
    if jobs:
        return "%d %s%s of %d jobs" % (len(holders), word, keeping, len(jobs))
    return "%d %s%s" % (len(holders), word, keeping)


def explain(error=None, gpu=None, sample=None, timeout=TIMEOUT_SECS):
    """One or two lines on who holds the memory of the GPU `error` ran out of (or GPU `gpu`,
    an NVML index), and the command that frees what can be freed."""
    result = diagnose(sample=sample, timeout=timeout)
    report = result.get("report") or {}
    gpus = report.get("gpus") or []
    index = gpu if gpu is not None else (_gpu_of(error, gpus) if error is not None else None)
    chosen = [g for g in gpus if index is None or g.get("index") == index]
    if not chosen:
        return "vramguard: GPU %s is not on this node (CUDA_VISIBLE_DEVICES=%s)" % (
            index,
            _visible(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), 120),
        )
    steps = (result.get("verdict") or {}).get("next_steps") or []
    lines = []
    for g in chosen:
        lines.append(_explain_gpu(g, steps))
    return "\n".join(lines)


def _names_gpu(command, index):
    """Whether a `vramguard …` command acts on GPU `index` (`--gpu 0,3`)."""
    words = (command or "").split()
    for i, word in enumerate(words[:-1]):
        if word == "--gpu" and str(index) in words[i + 1].split(","):
            return True
    return False


def _unexplained_bytes(g):
    """Bytes whose holder vramguard could not see (the report's "unexplained" memory)."""
    total = 0
    for h in g.get("holders") or []:
        unseen_exit = h.get("class") == "exited" and not h.get("keepers") and h.get("kept_by_unseen")
        if h.get("class") == "foreign" or unseen_exit:
            total += h.get("used_bytes") or 0
    unaccounted = g.get("unaccounted") or {}
    if unaccounted.get("significant") and unaccounted.get("cause") in ("other_namespace", "unknown"):
        total += unaccounted.get("bytes") or 0
    return total


def _explain_gpu(g, steps):
    index = g.get("index")
    own = os.getpid()
    command = next((s["command"] for s in steps if _names_gpu(s.get("command"), index)), None)
    holders = g.get("holders") or []
    reclaimable = [h for h in holders if (h.get("action") or {}).get("reclaimable")]
    if reclaimable:
        # What a default reclaim gives back, as vramguard counts it (an exited pid's memory
        # comes back with its keepers, which are unlisted and hold no bytes of their own).
        held = g.get("reclaimable_bytes")
        if held is None:
            held = sum(h.get("used_bytes") or 0 for h in reclaimable)
            hidden = [h for h in reclaimable if h.get("used_bytes") is None]
            if hidden and (g.get("unaccounted") or {}).get("significant"):
                held += g["unaccounted"].get("bytes") or 0
        return "vramguard: %s on GPU %s is held by %s: %s" % (
            _size(held),
            index,
            _holder_phrase(reclaimable),
            _visible(command or "vramguard reclaim --gpu %s" % index, 200),
        )
    ghost = g.get("ghost_bytes") or 0
    if ghost:
        why = _visible(" ".join(((g.get("unaccounted") or {}).get("explanation") or [])[:1]), 200)
        return "vramguard: %s on GPU %s is held by no live job%s%s" % (
            _size(ghost),
            index,
            ": " + why if why else "",
            "; next: " + _visible(command, 200) if command else "",
        )
    unseen = _unexplained_bytes(g)
    if unseen:
        return (
            "vramguard: %s on GPU %s is held by what vramguard cannot see from here (another "
            "PID namespace, or other users' processes): not known to be a live job's; run "
            "vramguard as root on the host" % (_size(unseen), index)
        )
    memory = g.get("memory") or {}
    mine = sum(h.get("used_bytes") or 0 for h in holders if h.get("pid") == own)
    others = [h for h in holders if h.get("pid") != own and h.get("used_bytes")]
    others.sort(key=lambda h: h["used_bytes"], reverse=True)
    parts = [
        "%s by pid %s (%s, %s)"
        % (_size(h["used_bytes"]), h["pid"], _visible(h.get("comm") or "?", 32), h["class"])
        for h in others[:3]
    ]
    text = "vramguard: GPU %s has %s of %s in use, all by live jobs" % (
        index,
        _size(memory.get("used") or 0),
        _size(memory.get("total") or 0),
    )
    if mine:
        text += "; this process (pid %d) holds %s" % (own, _size(mine))
    if parts:
        text += "; others: " + ", ".join(parts)
    return text + "; nothing of it can be reclaimed"


def explain_oom(sample=None, file=None):
    """Opt in: after the traceback of an uncaught CUDA out-of-memory error, print who holds
    the GPU's memory and the command that frees it. Installs a `sys.excepthook` that calls
    the one it replaces first; calling it again changes nothing."""
    previous = sys.excepthook
    if getattr(previous, "_vramguard_explain_oom", False):
        return

    def hook(kind, error, traceback):
        previous(kind, error, traceback)
        if not _is_cuda_oom(error):
            return
        try:
            text = explain(error, sample=sample)
        except Exception as e:  # noqa: BLE001 - the hook must never raise over the traceback
            text = "vramguard: could not explain the out-of-memory error: %s" % _visible(e, 300)
        print(text, file=file if file is not None else sys.stderr)

    hook._vramguard_explain_oom = True
    sys.excepthook = hook
