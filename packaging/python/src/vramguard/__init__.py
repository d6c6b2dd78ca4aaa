"""vramguard from Python: who holds a GPU's memory, why, and the command that frees it.

    import vramguard

    report = vramguard.status()        # `vramguard status --json`, parsed
    result = vramguard.diagnose()      # `vramguard diagnose --json`, parsed
    vramguard.explain_oom()            # opt in: explain CUDA out-of-memory errors

After `explain_oom()`, an uncaught `torch.cuda.OutOfMemoryError` prints, under the usual
traceback, who holds the GPU's memory and what frees it, for example::

    vramguard: 18.0 GiB on GPU 0 is held by 3 orphans of job pgid:13622: vramguard reclaim --gpu 0

In a notebook or a `try` block, `vramguard.explain(error)` returns the same text. An OOM
raised in another thread is explained too; under torchrun the ranks on one node ask the
binary once between them, and the explanation takes at most 1 s.

    with vramguard.guard():            # or @vramguard.guard() on a function
        train()

ends this process's own children that hold a GPU when the block is left (return, exception,
SIGTERM or SIGINT): SIGTERM, SIGKILL after a grace, then a wait for their memory; see
`guard()` for exactly what it may signal (nothing but those) and how signals are chained.

Every function runs the `vramguard` binary installed with this package (or the one named by
`VRAMGUARD_BINARY`, else the first on PATH). Without root it sees less: other users'
processes by pid only (the report's `limitations` say what is missing).
"""

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

__all__ = [
    "VramguardError",
    "binary",
    "diagnose",
    "explain",
    "explain_oom",
    "guard",
    "Guard",
    "status",
]

#: How long one call of the binary may take: the default sampling window is 2 s.
TIMEOUT_SECS = 60.0


class VramguardError(RuntimeError):
    """The vramguard binary could not be run, or printed no JSON (its message says why)."""


def _trusted(path):
    """`path` as an absolute path, if it may be run: as root, only a file root owns that no
    one else may write (a binary another user can replace would run as root)."""
    path = os.path.abspath(path)
    if os.geteuid() != 0:
        return path
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_uid != 0 or st.st_mode & 0o022:
        return None
    return path


def binary():
    """The path of the vramguard binary these functions run."""
    named = os.environ.get("VRAMGUARD_BINARY")
    if named:
        if not os.path.isabs(named):
            raise VramguardError(
                "VRAMGUARD_BINARY must be an absolute path, not %r" % _visible(named, 200)
            )
        return named
    # The script installed with this module first: pip puts it beside the interpreter's.
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        if folder:
            candidate = os.path.join(folder, "vramguard")
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
    # PATH: an empty entry or "." means the current directory, which may be anyone's.
    path = os.pathsep.join(
        p for p in os.environ.get("PATH", os.defpath).split(os.pathsep)
        if p and os.path.isabs(p)
    )
    found = shutil.which("vramguard", path=path)
    if found and _trusted(found):
        return _trusted(found)
    raise VramguardError(
        "the vramguard binary is neither installed beside this module nor on PATH; "
        "reinstall it with `pip install --force-reinstall vramguard`"
    )


def _duration(value):
    if isinstance(value, (int, float)):
        return "%gms" % (float(value) * 1000.0)
    return str(value)


def _run_json(command, gpus, sample, timeout, extra=()):
    argv = [binary(), command, "--json"] + list(extra)
    if gpus is not None:
        if isinstance(gpus, (int, str)):
            gpus = [gpus]
        argv += ["--gpu", ",".join(str(g) for g in gpus)]
    if sample is not None:
        argv += ["--sample", _duration(sample)]
    try:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    except OSError as e:
        raise VramguardError("could not run %s: %s" % (argv[0], e)) from e
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        # subprocess.run would wait for the killed child without limit: a thread of it stuck
        # in the driver (the GPU in a bad state, when this is asked) keeps it alive. It is
        # killed and left behind; the budget holds.
        child.kill()
        try:
            child.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (child.stdout, child.stderr):
            try:
                pipe.close()
            except OSError:
                pass
        raise VramguardError(
            "`vramguard %s` gave no answer within %g s" % (command, timeout)
        ) from e
    # `status` exits 2 when a GPU could not be read and `diagnose` 1 when the node is not
    # clean: both still print their document. No document means it failed.
    out = stdout.decode("utf-8", "replace").strip()
    if not out:
        message = stderr.decode("utf-8", "replace").strip().splitlines()
        raise VramguardError(
            message[-1] if message else "vramguard exited %d" % child.returncode
        )
    try:
        return json.loads(out)
    except ValueError as e:
        raise VramguardError("`vramguard %s --json` printed no JSON: %s" % (command, e)) from e


def status(gpus=None, sample=None, timeout=TIMEOUT_SECS, full_scan=False):
    """`vramguard status --json` as a dict: every GPU, every holder with its class and job.

    `gpus`: an index, a UUID or a list of them (default: all). `sample`: the sampling
    window, in seconds or as vramguard writes it ("2s"). `full_scan`: read every process's
    open files even when the driver's listed processes explain every byte (`--full-scan`;
    the document's `full_fd_scan` says which was done).
    """
    return _run_json("status", gpus, sample, timeout, ["--full-scan"] if full_scan else [])


def diagnose(gpus=None, sample=None, timeout=TIMEOUT_SECS):
    """`vramguard diagnose --json` as a dict: `checks`, `verdict` (with `next_steps`) and
    `report` (what `status()` returns)."""
    return _run_json("diagnose", gpus, sample, timeout)


# As vramguard's own sanitiser: direction marks, embeddings, overrides and isolates (the
# Arabic letter mark included); line and paragraph separators; invisible characters
# (zero-width space and joiners, word joiner and invisible operators, byte-order mark,
# Mongolian vowel separator, tag characters).
_BIDI = frozenset(
    [
        0x061C,
        0x200E,
        0x200F,
        *range(0x202A, 0x202F),
        *range(0x2066, 0x206A),
        0x2028,
        0x2029,
        *range(0x200B, 0x200E),
        *range(0x2060, 0x2065),
        0xFEFF,
        0x180E,
        *range(0xE0000, 0xE0080),
    ]
)


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
        elif code < 0x20 or code == 0x7F:
            out.append("\\x%02x" % code)
        elif 0x80 <= code < 0xA0 or code in _BIDI:
            # C1 controls, and the direction marks, overrides and isolates that reorder what
            # the reader sees: as vramguard's own output shows them.
            out.append("\\u{%x}" % code)
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


def _jobs_of(holders):
    """The jobs `holders` belong to, one name per job. A job is known by its leader's pid (an
    integer in the report) and by its label ("pgid:13", "slurm:4242.0"); holders that share
    either are of one job, so a holder named by its label and one named only by its leader
    make one job, not two. The name is the label, else "led by pid N"."""
    groups = []  # [identities, label or None], in the order first seen
    for h in holders:
        dead = h.get("dead_job") or {}
        label = (h.get("job") or {}).get("label") or dead.get("label")
        leader = dead.get("leader_pid")
        ids = set()
        if isinstance(label, str) and label:
            ids.add(("label", label))
        if isinstance(leader, int) and not isinstance(leader, bool):
            ids.add(("leader", leader))
        if not ids:
            continue
        joined = [ids, label if isinstance(label, str) and label else None]
        kept = []
        for g in groups:
            if g[0] & joined[0]:
                joined = [g[0] | joined[0], g[1] or joined[1]]
            else:
                kept.append(g)
        kept.append(joined)
        groups = kept
    names = []
    for ids, label in groups:
        if label is None:
            label = "led by pid %d" % min(v for k, v in ids if k == "leader")
        names.append(label)
    return names


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
    jobs = _jobs_of(holders)
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
    return _explain_result(diagnose(sample=sample, timeout=timeout), error, gpu)


def _explain_result(result, error=None, gpu=None):
    """`explain()` of a `diagnose()` document already at hand."""
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


#: The whole time the OOM hook may take to explain an error (the binary's call, or the wait
#: for another rank's answer): the traceback is already out, the job is waiting to die.
OOM_BUDGET_SECS = 1.0
#: The OOM hook's sampling window: just over the classifier's shortest window for telling
#: whether a process works (`work_min_window_ms`, 200 ms), so that an orphan is known idle and
#: its memory reclaimable; with no window (0) every orphan's work is unknown and the hook could
#: only say "held by no live job".
OOM_SAMPLE_SECS = 0.25
#: A node-wide answer younger than this is reused by the other ranks of the job.
NODE_ANSWER_SECS = 10.0
#: A lock older than this was left by a rank that died while asking: taken over.
NODE_LOCK_STALE_SECS = 5.0
#: The largest answer file read back (a diagnose document of a busy 8-GPU node is ~1 MiB).
NODE_ANSWER_MAX_BYTES = 16 << 20


def _job_key():
    """A key that every rank of one torchrun job on this node shares and no other job does,
    or None when this process is not a rank (neither LOCAL_RANK nor RANK is set).

    TORCHELASTIC_RUN_ID alone is not enough (`torchrun` without `--rdzv-id` gives every job
    "none"): the master's address and port (one job per port at a time) and the local
    agent (the ranks' parent, with its start time, so a reused pid is another key) go in
    too, and the user: another user's ranks never share a file with ours."""
    env = os.environ
    if env.get("LOCAL_RANK") is None and env.get("RANK") is None:
        return None
    parent = os.getppid()
    try:
        with open("/proc/%d/stat" % parent, "rb") as f:
            line = f.read(4096)
        started = line[line.rfind(b")") + 2 :].split()[19].decode("ascii")
    except (OSError, IndexError):
        started = "?"
    parts = [
        "uid=%d" % os.getuid(),
        "run=%s" % env.get("TORCHELASTIC_RUN_ID", ""),
        "master=%s:%s" % (env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")),
        "agent=%d@%s" % (parent, started),
    ]
    return "\n".join(parts)


def _node_dir():
    """Where the ranks of a node leave their answer: VRAMGUARD_NODE_DIR when set (the
    tests), /dev/shm (memory, per node) when it is a usable directory, else the temp
    directory."""
    named = os.environ.get("VRAMGUARD_NODE_DIR")
    if named:
        return named
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


def _read_answer(path, fresh_secs):
    """The cached answer at `path` if it is a regular file of ours, written by no one else
    (no group or other write), younger than `fresh_secs`: ("result", doc) or ("error",
    text); None otherwise. Never follows a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.getuid()
            or st.st_mode & 0o022
            or time.time() - st.st_mtime > fresh_secs
            or st.st_size > NODE_ANSWER_MAX_BYTES
        ):
            return None
        chunks, size = [], 0
        while size <= NODE_ANSWER_MAX_BYTES:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        answer = json.loads(b"".join(chunks).decode("utf-8"))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if isinstance(answer, dict) and isinstance(answer.get("result"), dict):
        return ("result", answer["result"])
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return ("error", answer["error"])
    return None


def _write_answer(path, answer):
    """Writes `answer` (JSON) beside `path` and renames it over: readers see all or none."""
    temporary = "%s.%d.tmp" % (path, os.getpid())
    try:
        fd = os.open(
            temporary,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(answer).encode("utf-8"))
        os.rename(temporary, path)
    except OSError:
        try:
            os.unlink(temporary)
        except OSError:
            pass


def _take_lock(lock):
    """Creates the lock file (O_EXCL, never through a symlink); takes over a stale one of
    ours once. True when this process holds it."""
    for attempt in (1, 2):
        try:
            fd = os.open(
                lock,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
        except FileExistsError:
            try:
                st = os.lstat(lock)
            except OSError:
                continue
            stale = time.time() - st.st_mtime > NODE_LOCK_STALE_SECS
            if attempt == 1 and stale and st.st_uid == os.getuid() and stat.S_ISREG(st.st_mode):
                try:
                    os.unlink(lock)
                except OSError:
                    pass
                continue
            return False
        except OSError:
            return False
        os.close(fd)
        return True
    return False


def _oom_paths():
    """(lock file, answer file) of this process's torchrun job on this node, or None when
    it is not a rank. The names carry the user and a hash of the job's key."""
    key = _job_key()
    if key is None:
        return None
    base = os.path.join(
        _node_dir(),
        "vramguard-oom-%d-%s" % (os.getuid(), hashlib.sha256(key.encode()).hexdigest()[:20]),
    )
    return base + ".lock", base + ".json"


def _oom_diagnose(sample, budget):
    """`diagnose()` for the OOM hook, within `budget` seconds. Under torchrun the first rank
    on the node to ask runs the binary and leaves its answer in a file (in /dev/shm, named
    by the job's key) that the other ranks read: one `diagnose` per node, not one per rank.
    A file someone else made (another user, a symlink) is never trusted: the rank then asks
    the binary itself."""
    paths = _oom_paths()
    if paths is None:
        return diagnose(sample=sample, timeout=budget)
    deadline = time.monotonic() + budget
    lock, answer_path = paths

    def use(answer):
        if answer[0] == "result":
            return answer[1]
        raise VramguardError(answer[1])

    answer = _read_answer(answer_path, NODE_ANSWER_SECS)
    if answer is not None:
        return use(answer)
    if _take_lock(lock):
        try:
            # The rank before may have written its answer and let go of the lock between
            # the first look and this one.
            answer = _read_answer(answer_path, NODE_ANSWER_SECS)
            if answer is not None:
                return use(answer)
            try:
                result = diagnose(sample=sample, timeout=max(0.05, deadline - time.monotonic()))
            except VramguardError as e:
                _write_answer(answer_path, {"error": str(e)})
                raise
            _write_answer(answer_path, {"result": result})
            return result
        finally:
            try:
                os.unlink(lock)
            except OSError:
                pass
    try:
        st = os.lstat(lock)
        foreign = st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode)
    except OSError:
        foreign = False
    if foreign:
        return diagnose(sample=sample, timeout=max(0.05, deadline - time.monotonic()))
    # Another rank is asking: its answer, within what is left of the budget.
    while time.monotonic() < deadline:
        answer = _read_answer(answer_path, NODE_ANSWER_SECS)
        if answer is not None:
            return use(answer)
        time.sleep(0.02)
    raise VramguardError(
        "another rank of this job asked vramguard and gave no answer within %g s" % budget
    )


def _print_explanation(error, sample, budget, file):
    try:
        text = _explain_result(_oom_diagnose(sample, budget), error)
    except Exception as e:  # noqa: BLE001 - the hook must never raise over the traceback
        text = "vramguard: could not explain the out-of-memory error: %s" % _visible(e, 300)
    print(text, file=file if file is not None else sys.stderr)


def explain_oom(sample=OOM_SAMPLE_SECS, file=None, budget=OOM_BUDGET_SECS):
    """Opt in: after the traceback of an uncaught CUDA out-of-memory error, in the main
    thread (`sys.excepthook`) or in any other (`threading.excepthook`), print who holds the
    GPU's memory and the command that frees it. Each hook calls the one it replaces first;
    calling `explain_oom()` again changes nothing.

    It takes at most `budget` seconds (1 s): the binary samples for `sample` seconds (0.25 s,
    the shortest window that tells an idle orphan from a working process) and is stopped
    after the budget; a node whose driver is slow to open (no persistence mode) may need a
    larger budget. Under torchrun (LOCAL_RANK or RANK set) the ranks of a job on one node ask
    the binary once between them: the first leaves its answer in /dev/shm for the others.
    """
    previous = sys.excepthook
    if not getattr(previous, "_vramguard_explain_oom", False):

        def hook(kind, error, traceback):
            previous(kind, error, traceback)
            try:
                if _is_cuda_oom(error):
                    _print_explanation(error, sample, budget, file)
            except Exception:  # noqa: BLE001 - the hook must never raise in its turn
                pass

        hook._vramguard_explain_oom = True
        sys.excepthook = hook

    previous_thread = threading.excepthook
    if not getattr(previous_thread, "_vramguard_explain_oom", False):

        def thread_hook(args):
            previous_thread(args)
            try:
                if _is_cuda_oom(args.exc_value):
                    _print_explanation(args.exc_value, sample, budget, file)
            except Exception:  # noqa: BLE001 - the hook must never raise in its turn
                pass

        thread_hook._vramguard_explain_oom = True
        threading.excepthook = thread_hook


from ._guard import Guard, guard  # noqa: E402 - it uses the functions above
