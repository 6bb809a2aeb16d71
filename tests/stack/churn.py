"""A second, busier application on the volume: rewrites a 16 MiB file in
64 KiB chunks, each followed by fsync, until a stop file appears, so that
requests are always in flight when the writer changes. Any error ends it
with a traceback and a non-zero exit.

Usage: churn.py FILE STOP"""

import os
import sys

path, stop = sys.argv[1], sys.argv[2]
chunk = os.urandom(64 * 1024)
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
offset = 0
while not os.path.exists(stop):
    os.pwrite(fd, chunk, offset)
    os.fsync(fd)
    offset = (offset + len(chunk)) % (16 * 1024 * 1024)
os.close(fd)
