"""`python3 fetch.py URL [TIMEOUT_S]`: print the body of an HTTP GET (curl may be missing)."""

import sys
import urllib.request

with urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]) if len(sys.argv) > 2 else 5) as r:
    sys.stdout.write(r.read().decode("utf-8", "replace"))
