"""An application on the volume: SQLite committing one row per transaction
with synchronous=FULL, as a database would, until a stop file appears.

Usage: commits.py DB LOG STOP. Each committed row's id and the time it was
committed go to LOG (outside the volume), one line each, flushed at once.
Any error (an I/O error from the disk included) ends it with a traceback
and a non-zero exit: that is what an application would see."""

import os
import sqlite3
import sys
import time

db, log_path, stop = sys.argv[1], sys.argv[2], sys.argv[3]
con = sqlite3.connect(db, isolation_level=None)
con.execute("PRAGMA synchronous=FULL")
con.execute("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, at REAL, pad TEXT)")
(last,) = con.execute("SELECT COALESCE(MAX(id), 0) FROM t").fetchone()
with open(log_path, "a") as log:
    row = last
    while not os.path.exists(stop):
        row += 1
        con.execute("BEGIN")
        con.execute("INSERT INTO t VALUES (?, ?, ?)", (row, time.time(), "x" * 200))
        con.execute("COMMIT")
        log.write(f"{row} {time.time():.6f}\n")
        log.flush()
con.close()
