"""`explain_oom()`: the job count, thread exceptions, one `diagnose` per node under torchrun,
and its 1 s budget. The binary is a stand-in shell script here (VRAMGUARD_BINARY): it
prints a canned `diagnose --json` document and records every call, so that the calls can be
counted and made slow."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

import support
from support import FAKE_TORCH, HERE, SRC, World

sys.path.insert(0, SRC)
import vramguard  # noqa: E402

GIB = 1 << 30

#: One dead job, pgid 13, with two orphans: the report names the first by its job's label
#: and the second only by its dead leader's pid (an integer).
ONE_JOB_TWO_ORPHANS = [
    {"pid": 14, "class": "orphan", "used_bytes": GIB, "action": {"reclaimable": True},
     "job": {"label": "pgid:13"}, "dead_job": {"leader_pid": 13, "label": None}},
    {"pid": 15, "class": "orphan", "used_bytes": GIB, "action": {"reclaimable": True},
     "job": None, "dead_job": {"leader_pid": 13, "label": None}},
]

DOCUMENT = {
    "report": {"gpus": [{"index": 0, "uuid": "GPU-0", "holders": ONE_JOB_TWO_ORPHANS,
                         "memory": {"used": 2 * GIB, "total": 80 * GIB}}]},
    "verdict": {"clean": False, "next_steps": [{"command": "vramguard reclaim --gpu 0"}]},
}
EXPLAINED = "vramguard: 2.0 GiB on GPU 0 is held by 2 orphans of job pgid:13: vramguard reclaim --gpu 0"

FAKE_BINARY = """#!/bin/sh
echo "$$ $*" >> "$FAKE_VG_CALLS"
[ -n "$FAKE_VG_HANG" ] && exec sleep 30
[ -n "$FAKE_VG_DELAY" ] && sleep "$FAKE_VG_DELAY"
exec cat "$FAKE_VG_DOCUMENT"
"""

OOM_IN_MAIN = """
import torch, vramguard
vramguard.explain_oom()
raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB")
"""


class ExplainTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="vramguard-py-explain-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.binary = os.path.join(self.dir, "vramguard")
        with open(self.binary, "w") as f:
            f.write(FAKE_BINARY)
        os.chmod(self.binary, 0o755)
        self.calls = os.path.join(self.dir, "calls")
        self.document = os.path.join(self.dir, "diagnose.json")
        with open(self.document, "w") as f:
            json.dump(DOCUMENT, f)
        # The node-wide answers go to a folder of this test's own, not /dev/shm.
        self.node = os.path.join(self.dir, "node")
        os.mkdir(self.node)

    def env(self, **extra):
        env = dict(os.environ)
        for name in ("LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                     "CUDA_VISIBLE_DEVICES", "VRAMGUARD_SIM"):
            env.pop(name, None)
        env.update(
            PYTHONPATH=os.pathsep.join([SRC, FAKE_TORCH]),
            VRAMGUARD_BINARY=self.binary,
            VRAMGUARD_NODE_DIR=self.node,
            FAKE_VG_CALLS=self.calls,
            FAKE_VG_DOCUMENT=self.document,
        )
        env.update(extra)
        return env

    def start(self, code, **env):
        return subprocess.Popen([sys.executable, "-c", code], env=self.env(**env),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=HERE)

    def calls_made(self):
        try:
            with open(self.calls) as f:
                return len(f.read().splitlines())
        except FileNotFoundError:
            return 0

    def test_two_orphans_of_one_job_are_one_job(self):
        self.assertEqual(vramguard._holder_phrase(ONE_JOB_TWO_ORPHANS),
                         "2 orphans of job pgid:13")
        other = dict(ONE_JOB_TWO_ORPHANS[1], pid=16, dead_job={"leader_pid": 20, "label": None})
        self.assertEqual(vramguard._holder_phrase(ONE_JOB_TWO_ORPHANS + [other]),
                         "3 orphans of 2 jobs")
        # And as the OOM hook prints it.
        out = self.start(OOM_IN_MAIN).communicate(timeout=30)[1].decode()
        self.assertIn(EXPLAINED, out)

    def test_an_oom_in_a_thread_is_explained_after_its_traceback(self):
        proc = self.start("""
import threading, torch, vramguard
vramguard.explain_oom()
vramguard.explain_oom()  # a second call changes nothing
def step(error):
    raise error
for error in (ValueError("not an OOM"), torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB")):
    t = threading.Thread(target=step, args=(error,))
    t.start()
    t.join()
""")
        out, err = proc.communicate(timeout=30)
        err = err.decode()
        self.assertEqual(proc.returncode, 0, err)
        traceback = err.index("torch.cuda.OutOfMemoryError")
        self.assertIn("ValueError: not an OOM", err)
        self.assertGreater(err.index(EXPLAINED), traceback)
        self.assertEqual(err.count("vramguard: "), 1, err)
        self.assertEqual(self.calls_made(), 1)

    def test_the_ranks_of_one_job_ask_the_binary_once_per_node(self):
        def ranks(run, count):
            env = dict(TORCHELASTIC_RUN_ID=run, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                       FAKE_VG_DELAY="0.3")
            procs = [self.start(OOM_IN_MAIN, LOCAL_RANK=str(r), RANK=str(r), **env)
                     for r in range(count)]
            return [p.communicate(timeout=30)[1].decode() for p in procs]

        for err in ranks(uuid.uuid4().hex, 4):
            self.assertIn(EXPLAINED, err)
        self.assertEqual(self.calls_made(), 1, "4 ranks of one job asked %d times"
                         % self.calls_made())
        # Another job on the node asks for itself.
        for err in ranks(uuid.uuid4().hex, 2):
            self.assertIn(EXPLAINED, err)
        self.assertEqual(self.calls_made(), 2)
        # Not under torchrun: every process asks.
        self.start(OOM_IN_MAIN).communicate(timeout=30)
        self.assertEqual(self.calls_made(), 3)

    def test_a_planted_answer_or_symlink_is_never_trusted(self):
        env = dict(TORCHELASTIC_RUN_ID=uuid.uuid4().hex, LOCAL_RANK="0", RANK="0")
        where = self.start("import vramguard; print(*vramguard._oom_paths())", **env)
        lock, answer = where.communicate(timeout=30)[0].decode().split()
        self.assertEqual(os.path.dirname(answer), self.node)
        lie = os.path.join(self.dir, "lie.json")
        with open(lie, "w") as f:
            json.dump({"result": {"report": {"gpus": []}, "verdict": {}}}, f)
        # A symlink as the answer, and one as the lock: neither is followed or believed.
        os.symlink(lie, answer)
        os.symlink(os.path.join(self.dir, "elsewhere"), lock)
        err = self.start(OOM_IN_MAIN, **env).communicate(timeout=30)[1].decode()
        self.assertIn(EXPLAINED, err)
        self.assertEqual(self.calls_made(), 1)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "elsewhere")))
        # An answer file others may write: not believed either.
        os.unlink(answer)
        os.unlink(lock)
        with open(answer, "w") as f:
            json.dump({"result": {"report": {"gpus": []}, "verdict": {}}}, f)
        os.chmod(answer, 0o666)
        err = self.start(OOM_IN_MAIN, **env).communicate(timeout=30)[1].decode()
        self.assertIn(EXPLAINED, err)
        self.assertEqual(self.calls_made(), 2)

    def test_the_hook_takes_at_most_one_second(self):
        began = time.monotonic()
        proc = self.start(OOM_IN_MAIN, FAKE_VG_HANG="1")
        err = proc.communicate(timeout=30)[1].decode()
        took = time.monotonic() - began
        self.assertIn("vramguard: could not explain the out-of-memory error: `vramguard "
                      "diagnose` gave no answer within 1 s", err)
        # 1 s for the binary, the rest for starting Python on a loaded machine.
        self.assertLess(took, 3.0, err)
        self.assertEqual(self.calls_made(), 1)
        with open(self.calls) as f:
            self.assertIn("diagnose --json --sample 250ms", f.read())


class VisibleTextTest(unittest.TestCase):
    def test_names_are_escaped_as_vramguard_escapes_them(self):
        # Another user's command name in the hook's line: controls, C1 and the direction
        # overrides that would reorder the line (red-team finding: these were printed as is).
        shown = vramguard._visible("a\x1b]52;b\u202ec\u2066d\x9be\u200ff")
        self.assertEqual(shown, "a\\e]52;b\\u{202e}c\\u{2066}d\\u{9b}e\\u{200f}f")
        self.assertEqual(vramguard._visible("python3 train.py"), "python3 train.py")
        # The Arabic letter mark, separators and invisible characters too (red-team finding).
        shown = vramguard._visible("a\u061cb\u2028c\u200bd\ufeffe\U000e0041f")
        self.assertEqual(
            shown, "a\\u{61c}b\\u{2028}c\\u{200b}d\\u{feff}e\\u{e0041}f"
        )


class BinaryTest(unittest.TestCase):
    def test_a_relative_binary_or_one_in_the_current_directory_is_not_run(self):
        # Red-team finding: VRAMGUARD_BINARY could be relative, and an empty PATH entry made
        # shutil.which look in the current directory, which may be anyone's.
        saved = dict(os.environ)
        self.addCleanup(lambda: (os.environ.clear(), os.environ.update(saved)))
        os.environ["VRAMGUARD_BINARY"] = "vramguard"
        with self.assertRaises(vramguard.VramguardError):
            vramguard.binary()
        here = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, here, True)
        planted = os.path.join(here, "vramguard")
        with open(planted, "w") as f:
            f.write("#!/bin/sh\nexit 0\n")
        os.chmod(planted, 0o755)
        del os.environ["VRAMGUARD_BINARY"]
        os.environ["PATH"] = ":."
        cwd = os.getcwd()
        os.chdir(here)
        self.addCleanup(os.chdir, cwd)
        try:
            found = vramguard.binary()
        except vramguard.VramguardError:
            found = None
        self.assertNotIn(found, (planted, "vramguard", "./vramguard"))


class ExplainOnTheSimulatorTest(unittest.TestCase):
    def test_status_answers_from_the_listed_processes_unless_asked_for_a_full_scan(self):
        # A live job holding memory, nothing unexplained: `status()` reads only the listed
        # processes; `status(full_scan=True)` reads every process's open files. No
        # shared-memory directory: a segment another test leaves in /dev/shm would ask for
        # the full scan.
        world = World()
        self.addCleanup(world.close)
        job = subprocess.Popen(
            [support.binary(), "sim", "hold", "--gpu", "0", "--bytes", "1GiB",
             "--lifetime", "60s"],
            env=world.env(), start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(job.wait)
        self.addCleanup(job.kill)
        support.wait_until("the job to hold its allocation", lambda: world.holders())
        config = os.path.join(world.dir, "no-shm.toml")
        with open(config, "w") as f:
            f.write("[shm]\ndirs = []\n")
        script = ("import json, vramguard; print(json.dumps([vramguard.status()['full_fd_scan'], "
                  "vramguard.status(full_scan=True)['full_fd_scan']]))")
        proc = subprocess.run([sys.executable, "-c", script],
                              env=world.env(VRAMGUARD_CONFIG=config),
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stderr.decode())
        self.assertEqual(json.loads(proc.stdout), [False, True], proc.stderr.decode())

    def test_a_real_orphan_is_named_within_the_budget(self):
        # The real binary on the simulated driver: a job (leader and one worker) in a
        # session of its own, the leader SIGKILLed; the worker is an orphan of that job. The
        # hook's short sampling window must still tell that it is idle, or the explanation
        # falls back to "held by no live job".
        world = World()
        self.addCleanup(world.close)
        job = subprocess.Popen(
            [support.binary(), "sim", "hold", "--gpu", "0", "--bytes", "2GiB", "--workers", "1",
             "--worker-bytes", "1GiB", "--lifetime", "60s"],
            env=world.env(), start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(job.wait)
        self.addCleanup(job.kill)
        holders = support.wait_until("the job to hold 2 GPU allocations",
                                     lambda: len(world.holders()) == 2 and world.holders())
        worker = next(p for p in holders if p != job.pid)
        world.track(worker, support.stat_of(worker)[1])
        job.kill()
        job.wait()
        began = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", OOM_IN_MAIN], env=world.env(),
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        took = time.monotonic() - began
        err = proc.stderr.decode()
        self.assertIn("vramguard: 1.0 GiB on GPU 0 is held by 1 orphan of job pgid:%d: "
                      "vramguard reclaim --gpu 0" % job.pid, err)
        self.assertLess(took, 3.0, err)


if __name__ == "__main__":
    unittest.main()
