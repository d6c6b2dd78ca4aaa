# Holds the file argv[1] open only in a thread's own fd table (unshare(CLONE_FILES)), so the
# process's /proc/PID/fd does not show it; prints "ready" once it does, then sleeps.
import ctypes, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
ready = threading.Event()
def hide():
    if libc.unshare(0x400) != 0:
        print("unshare failed", ctypes.get_errno(), flush=True)
        os._exit(3)
    os.open(sys.argv[1], os.O_RDONLY)
    ready.set()
    time.sleep(600)
threading.Thread(target=hide, daemon=True).start()
ready.wait()
print("ready", flush=True)
time.sleep(600)
