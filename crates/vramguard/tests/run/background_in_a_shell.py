"""`vramguard run … &` typed into an interactive bash on a pseudo-terminal, then a command,
then a `vramguard run` in the foreground: prints one JSON line saying whether bash kept the
terminal and ran the command, and whether the foreground job had the terminal. Kills what it
started, by pid (bash, vramguard, the job)."""
import json, os, pty, select, signal, sys, time

vg = sys.argv[1]
pid, fd = pty.fork()
if pid == 0:
    os.environ["PS1"] = "PROMPT$ "
    os.execv("/bin/bash", ["bash", "--norc", "--noprofile", "-i"])


def read(seconds):
    out, end = b"", time.time() + seconds
    while time.time() < end:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                out += os.read(fd, 4096)
            except OSError:
                break
    return out.decode(errors="replace")


def stat(p):
    try:
        text = open("/proc/%d/stat" % p).read()
    except FileNotFoundError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return {"state": fields[0], "pgrp": int(fields[2]), "tpgid": int(fields[5])}


def children(p):
    try:
        return [int(x) for x in open("/proc/%d/task/%d/children" % (p, p)).read().split()]
    except OSError:
        return []


read(1.5)
os.write(fd, ("%s run --isolation group -- sleep 30 &\n" % vg).encode())
read(2.0)
started = children(pid)
jobs = [c for v in started for c in children(v)]
bash = stat(pid)
os.write(fd, b"echo still-here-$((40+2))\n")
out = read(2.0)
# In the foreground, the job gets the terminal (Ctrl-C reaches it), and bash gets it back.
os.write(fd, ("%s run --isolation group -- sh -c 'set -- $(cat /proc/$$/stat); "
              "[ \"$5\" = \"$8\" ] && echo job-has-$((6*7))-terminal'\n" % vg).encode())
fg = read(3.0)
os.write(fd, b"echo back-$((40+3))\n")
back = read(2.0)
result = {
    "keeps_terminal": bool(bash) and bash["tpgid"] == bash["pgrp"],
    "ran_command": "still-here-42" in out,
    "bash_alive": (stat(pid) or {}).get("state") not in (None, "Z"),
    "started": len(started),
    "foreground_job_has_terminal": "job-has-42-terminal" in fg,
    "terminal_back_after_foreground": "back-43" in back,
}
for p in jobs + started + [pid]:
    try:
        os.kill(p, signal.SIGKILL)
    except ProcessLookupError:
        pass
try:
    os.waitpid(pid, 0)
except ChildProcessError:
    pass
print(json.dumps(result))
