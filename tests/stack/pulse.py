"""A client that writes 4 KiB blocks at random offsets of a disk, one at a
time, each synchronous (O_DSYNC), and logs the time each completed, until
a stop file appears. Any error ends it with a traceback and a non-zero
exit. The gaps between completions are the stalls a client sees.

Usage: pulse.py DISK LOG STOP"""

import os
import random
import sys
import time

disk, log_path, stop = sys.argv[1], sys.argv[2], sys.argv[3]
fd = os.open(disk, os.O_RDWR | os.O_DSYNC)
blocks = os.fstat(fd).st_size // 4096
data = os.urandom(4096)
with open(log_path, "a") as log:
    while not os.path.exists(stop):
        os.pwrite(fd, data, random.randrange(blocks) * 4096)
        log.write(f"{time.time():.6f}\n")
        log.flush()
os.close(fd)
