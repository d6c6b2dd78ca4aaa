"""`vramguard.guard()` on real processes: a guarded script (a process of its own) starts
simulated GPU holders as its children; the test checks which of them the guard ended, that
their memory came back, and that nothing else was touched."""

import os
import signal
import time
import unittest

from support import PREAMBLE, Script, World, alive, end, start_holder, wait_until


class GuardTest(unittest.TestCase):
    def setUp(self):
        self.world = World()
        self.addCleanup(self.world.close)

    def assert_ended_and_released(self, script, name="HOLDER"):
        pid, start = script.seen[name]
        self.assertFalse(alive(pid, start), "%s %d still runs" % (name, pid))
        self.assertNotIn(pid, self.world.holders(), "the memory of %d is still held" % pid)

    def test_exit_ends_a_gpu_holding_child(self):
        script = Script(self.world, PREAMBLE + """
with vramguard.guard(grace=5):
    child = hold()
print("DONE", flush=True)
""")
        script.expect("HOLDER")
        code, out, err = script.finish()
        self.assertEqual(code, 0, err)
        pid = script.seen["HOLDER"][0]
        self.assertIn("exit of pid %d: SIGTERM sent to its child pid %d" % (script.proc.pid, pid),
                      err)
        self.assertIn("(1.0 GiB on GPU 0)", err)
        self.assertIn("GPU memory of pid %d back after" % pid, err)
        self.assertIn("DONE", out)
        self.assert_ended_and_released(script)

    def test_an_exception_ends_the_child_and_still_propagates(self):
        script = Script(self.world, PREAMBLE + """
with vramguard.guard(grace=5):
    child = hold()
    raise ValueError("the training step failed")
""")
        script.expect("HOLDER")
        code, _, err = script.finish()
        self.assertEqual(code, 1, err)
        self.assertIn("exception ValueError of pid", err)
        self.assertIn("ValueError: the training step failed", err)
        self.assert_ended_and_released(script)

    def test_sigterm_to_the_guarded_process_ends_the_child_and_exits_143(self):
        script = Script(self.world, PREAMBLE + """
with vramguard.guard(grace=5):
    child = hold()
    print("READY 0 0", flush=True)
    time.sleep(60)
print("NOT REACHED", flush=True)
""")
        script.expect("HOLDER")
        script.expect("READY")
        script.proc.send_signal(signal.SIGTERM)
        code, out, err = script.finish()
        self.assertEqual(code, 128 + signal.SIGTERM, err)
        self.assertIn("SIGTERM received: ending the GPU-holding children", err)
        self.assertNotIn("NOT REACHED", out)
        self.assert_ended_and_released(script)

    def test_sigint_cleans_then_raises_keyboard_interrupt_and_restores_the_handler(self):
        script = Script(self.world, PREAMBLE + """
try:
    with vramguard.guard(grace=5):
        child = hold()
        print("READY 0 0", flush=True)
        time.sleep(60)
except KeyboardInterrupt:
    print("KeyboardInterrupt", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
          flush=True)
""")
        script.expect("HOLDER")
        script.expect("READY")
        script.proc.send_signal(signal.SIGINT)
        code, out, err = script.finish()
        self.assertEqual(code, 0, err)
        self.assertIn("KeyboardInterrupt True", out)
        self.assertIn("SIGINT received", err)
        self.assertIn("KeyboardInterrupt of pid", err)
        self.assert_ended_and_released(script)

    def test_an_ignored_sigint_stays_ignored_and_the_children_are_ended_on_exit(self):
        # `nohup`, or a shell without job control starting `python train.py &`: the process
        # chose not to die of Ctrl-C, and the guard must not make it. The script sends the
        # SIGINT to itself: a handler, had the guard installed one, runs at the loop's next
        # iteration, before SURVIVED is printed, so no sleep is needed to give it time.
        script = Script(self.world, PREAMBLE + """
signal.signal(signal.SIGINT, signal.SIG_IGN)
with vramguard.guard(grace=5):
    child = hold()
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(1000):
        pass
    print("SURVIVED", signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
print("DONE", signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
""")
        script.expect("HOLDER")
        code, out, err = script.finish()
        self.assertEqual(code, 0, err)
        self.assertIn("SURVIVED True", out)
        self.assertIn("DONE True", out)
        self.assertNotIn("SIGINT received", err)
        pid = script.seen["HOLDER"][0]
        self.assertIn("exit of pid %d: SIGTERM sent to its child pid %d" % (script.proc.pid, pid),
                      err)
        self.assert_ended_and_released(script)

    def test_a_child_that_ignores_sigterm_gets_sigkill_after_the_grace(self):
        script = Script(self.world, PREAMBLE + """
with vramguard.guard(grace=0.5):
    child = hold(ignore_term=True)
    began = time.monotonic()
print("TOOK %d 0" % ((time.monotonic() - began) * 1000), flush=True)
""")
        script.expect("HOLDER")
        took, _ = script.expect("TOOK")
        code, _, err = script.finish()
        self.assertEqual(code, 0, err)
        pid = script.seen["HOLDER"][0]
        self.assertIn("pid %d (vramguard) still alive 0.5 s after SIGTERM: SIGKILL sent" % pid,
                      err)
        self.assertGreaterEqual(took, 500, "SIGKILL came before the grace was over")
        self.assert_ended_and_released(script)

    def test_it_never_signals_a_non_descendant_a_child_without_gpu_another_user_or_itself(self):
        self.assertEqual(os.getuid(), 0, "this test starts a process of another user: run as root")
        # Not the guarded process's descendant: the test's own holder.
        other, other_start = start_holder(self.world.state)
        self.addCleanup(other.wait)
        self.addCleanup(end, other.pid, other_start)
        nvidia0 = os.path.join(self.world.dev, "nvidia0")
        script = Script(self.world, PREAMBLE + """
# The guarded process holds the GPU itself; and a child of another user that holds it too.
own = open(%(nvidia0)r)
with vramguard.guard(grace=5):
    holder = hold()
    plain = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report("PLAIN", plain.pid)
    nobody = subprocess.Popen(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
         "sh", "-c", "exec 3<%(nvidia0)s; exec sleep 60"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until("the other user's child to open the GPU",
               lambda: any(os.readlink("/proc/%%d/fd/%%s" %% (nobody.pid, fd)) == %(nvidia0)r
                           for fd in os.listdir("/proc/%%d/fd" %% nobody.pid)))
    report("NOBODY", nobody.pid)
print("AFTER 0 0", flush=True)
""" % {"nvidia0": nvidia0})
        for name in ("HOLDER", "PLAIN", "NOBODY", "AFTER"):
            script.expect(name)
        code, _, err = script.finish()
        self.assertEqual(code, 0, err)
        self.assert_ended_and_released(script)
        self.assertTrue(alive(other.pid, other_start), "a holder that is not its child was ended")
        self.assertTrue(alive(*script.seen["PLAIN"]), "a child without a GPU was ended")
        self.assertTrue(alive(*script.seen["NOBODY"]), "another user's child was ended")
        self.assertIn("pid %d (sleep) holds %s but is not this user's: left alone"
                      % (script.seen["NOBODY"][0], nvidia0), err)
        self.assertEqual(err.count("SIGTERM sent"), 1, err)

    def test_a_grandchild_recorded_while_it_ran_is_ended_after_its_parent_exited(self):
        script = Script(self.world, PREAMBLE + """
with vramguard.guard(grace=5, watch=0.05) as g:
    read, write = os.pipe()
    go_read, go_write = os.pipe()
    middle = os.fork()
    if middle == 0:
        # Only the ends it uses: if the script dies, go_read sees EOF and this one ends too.
        os.close(read)
        os.close(go_write)
        grandchild = hold()
        os.write(write, b"%d" % grandchild.pid)
        os.read(go_read, 1)
        os._exit(0)
    os.close(write)
    os.close(go_read)
    grandchild = int(os.read(read, 32))
    wait_until("the watcher to record the grandchild", lambda: grandchild in g._tracked)
    os.write(go_write, b"x")
    os.waitpid(middle, 0)
    # Its parent is gone: it is nobody's descendant in /proc now, only in the record.
    wait_until("the grandchild to be re-parented",
               lambda: open("/proc/%d/stat" % grandchild).read().rsplit(")", 1)[1].split()[1]
               != str(os.getpid()) and grandchild not in vramguard._guard._descendants(os.getpid()))
""")
        script.expect("HOLDER")
        code, _, err = script.finish()
        self.assertEqual(code, 0, err)
        self.assertIn("SIGTERM sent to its child pid %d" % script.seen["HOLDER"][0], err)
        self.assert_ended_and_released(script)

    def test_the_decorator_cleans_and_a_guard_in_a_thread_installs_no_handler(self):
        script = Script(self.world, PREAMBLE + """
@vramguard.guard(grace=5)
def train():
    hold()

train()
def in_thread():
    with vramguard.guard(grace=5):
        child = hold()
        print("HANDLER", int(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL), 0, flush=True)
worker = threading.Thread(target=in_thread)
worker.start()
worker.join()
""")
        first = script.expect("HOLDER")
        del script.seen["HOLDER"]
        second = script.expect("HOLDER")
        default, _ = script.expect("HANDLER")
        code, _, err = script.finish()
        self.assertEqual(code, 0, err)
        self.assertEqual(default, 1, "a guard outside the main thread changed SIGTERM's handler")
        self.assertIn("not the main thread: no signal handlers", err)
        for pid, start in (first, second):
            self.assertFalse(alive(pid, start), "holder %d still runs" % pid)
            self.assertIn("SIGTERM sent to its child pid %d" % pid, err)

    def test_a_signal_while_cleaning_lets_the_cleanup_finish_then_exits_143(self):
        script = Script(self.world, PREAMBLE + """
with vramguard.guard(grace=2):
    child = hold(ignore_term=True)
print("CLEANED 0 0", flush=True)
""")
        script.expect("HOLDER")
        wait_until("the guard to be in its grace", lambda: "SIGTERM sent" in script.peek_stderr())
        script.proc.send_signal(signal.SIGTERM)
        code, out, err = script.finish()
        self.assertEqual(code, 128 + signal.SIGTERM, err)
        self.assertIn("SIGTERM received while cleaning: acted on after the cleanup", err)
        self.assertIn("SIGKILL sent", err)
        self.assertNotIn("CLEANED", out)
        self.assert_ended_and_released(script)

    def test_a_previous_python_handler_is_chained_and_put_back(self):
        script = Script(self.world, PREAMBLE + """
def on_term(signum, frame):
    print("PREVIOUS %d 0" % signum, flush=True)
    raise SystemExit(7)
signal.signal(signal.SIGTERM, on_term)
try:
    with vramguard.guard(grace=5):
        child = hold()
        print("READY 0 0", flush=True)
        time.sleep(60)
finally:
    print("RESTORED %d 0" % (signal.getsignal(signal.SIGTERM) is on_term), flush=True)
""")
        script.expect("HOLDER")
        script.expect("READY")
        script.proc.send_signal(signal.SIGTERM)
        self.assertEqual(script.expect("PREVIOUS")[0], signal.SIGTERM)
        self.assertEqual(script.expect("RESTORED")[0], 1)
        code, _, err = script.finish()
        self.assertEqual(code, 7, err)
        self.assertIn("exit (SystemExit 7) of pid", err)
        self.assert_ended_and_released(script)

    def test_a_forked_copy_neither_cleans_nor_keeps_the_handler(self):
        nvidia0 = os.path.join(self.world.dev, "nvidia0")
        script = Script(self.world, PREAMBLE + """
own = open(%(nvidia0)r)   # the guarded process holds the GPU: so does a forked copy
with vramguard.guard(grace=5):
    child = hold()
    leaver = os.fork()
    if leaver != 0:
        os.waitpid(leaver, 0)
        print("AFTER-COPY %%d 0" %% int(child.poll() is None), flush=True)
    # else: a forked copy leaving the block on its own: it must not clean
if leaver == 0:
    os._exit(0)
with vramguard.guard(grace=5):
    sleeper = os.fork()
    if sleeper == 0:
        time.sleep(60)    # ended by the guard's SIGTERM, through the inherited handler
        os._exit(3)
    report("SLEEPER", sleeper)
status = os.waitpid(sleeper, 0)[1]
print("SLEEPER-END %%d %%d" %% (os.WIFSIGNALED(status), os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0), flush=True)
""" % {"nvidia0": nvidia0})
        script.expect("HOLDER")
        self.assertEqual(script.expect("AFTER-COPY")[0], 1, "the forked copy ended the holder: %s" % script.peek_stderr())
        script.expect("SLEEPER")
        self.assertEqual(script.expect("SLEEPER-END"), (1, signal.SIGTERM),
                         "the forked copy did not die of SIGTERM as without the guard")
        code, _, err = script.finish()
        self.assertEqual(code, 0, err)
        self.assert_ended_and_released(script)

    def test_a_recorded_pid_that_is_now_another_process_is_not_signalled(self):
        # A pid reused by a process that is not the script's: here a holder the test itself
        # started, recorded by hand with a start time one tick earlier, which is what a
        # reused pid looks like to the guard.
        child, start = start_holder(self.world.state)
        self.world.track(child.pid, start)
        script = Script(self.world, PREAMBLE + """
from vramguard._guard import _Tracked
pid, start = int(os.environ["OTHER_PID"]), int(os.environ["OTHER_START"])
with vramguard.guard(grace=5, watch=None) as g:
    g._tracked[pid] = _Tracked(pid, start - 1, "reused")
print("DONE", flush=True)
""", OTHER_PID=str(child.pid), OTHER_START=str(start))
        code, out, err = script.finish()
        self.assertEqual(code, 0, err)
        self.assertIn("DONE", out)
        self.assertNotIn("SIGTERM sent", err)
        self.assertTrue(alive(child.pid, start))

    def test_as_pid_1_of_a_pid_namespace_it_signals_nothing(self):
        # A container's entrypoint without an init adopts every orphan of the namespace: a
        # process a `docker exec` session left behind reads as its child. It got SIGTERM
        # (audit); now such a guard signals nothing, its own GPU-holding child included.
        import subprocess
        import sys
        inner = """\
import json, logging, os, subprocess, sys, time
import vramguard
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s %(message)s")
dev = os.path.join(json.load(open(os.environ["VRAMGUARD_SIM"]))["dev_dir"], "nvidia0")
with vramguard.guard(grace=1):
    child = subprocess.Popen(["sh", "-c", "exec 3<%s; exec sleep 30" % dev])
    time.sleep(0.5)
print("PID", os.getpid(), "CHILD_ALIVE", child.poll() is None, flush=True)
child.kill()
"""
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                            "-c", inner], env=self.world.env(), capture_output=True,
                           text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("PID 1 CHILD_ALIVE True", r.stdout, r.stderr)
        self.assertIn("PID 1 of its PID namespace", r.stderr)
        self.assertNotIn("SIGTERM sent", r.stderr)

    def test_children_alive_before_the_block_are_left_alone(self):
        # Red-team finding: an inner guard (a guarded evaluate() inside the training loop)
        # ended the outer loop's persistent workers at its exit. Only what started inside a
        # block is that block's to end.
        script = Script(self.world, PREAMBLE + """
before = hold()
report("BEFORE", before.pid)
with vramguard.guard(grace=5, watch=None):
    outer = hold()
    report("OUTER", outer.pid)
    with vramguard.guard(grace=5, watch=None):
        inner = hold()
        report("INNER", inner.pid)
    print("AFTER_INNER %d %d" % (int(outer.poll() is None), int(inner.poll() is None)),
          flush=True)
print("AFTER_OUTER %d %d" % (int(before.poll() is None), int(outer.poll() is None)),
      flush=True)
""")
        self.assertEqual(script.expect("AFTER_INNER"), (1, 0),
                         "the inner guard must end its own child only")
        self.assertEqual(script.expect("AFTER_OUTER"), (1, 0),
                         "the outer guard must end its child and leave the earlier one")
        code, _, err = script.finish()
        self.assertEqual(code, 0, err)
        self.assertTrue(alive(*script.seen["BEFORE"]))
        self.assertFalse(alive(*script.seen["OUTER"]))
        self.assertFalse(alive(*script.seen["INNER"]))


if __name__ == "__main__":
    unittest.main()
