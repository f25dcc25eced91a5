"""The heartbeat benchmark's worker: imports worker_lib only (no torch), beats at --rate Hz.

With --hang-at N, rank 1 stops beating after N beats in every attempt before --hang-attempts,
writing the monotonic time of its last beat to --out (a real sleep: nothing else happens).
"""

import argparse
import os
import time
from pathlib import Path

import worker_lib as ft

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

p = argparse.ArgumentParser()
p.add_argument("--rate", type=float, default=1000.0, help="beats per second")
p.add_argument("--seconds", type=float, default=10.0)
p.add_argument("--hang-at", type=int, default=None)
p.add_argument("--hang-attempts", type=int, default=0)
p.add_argument("--out", type=Path, default=None)
args = p.parse_args()

period = 1.0 / args.rate
hangs = args.hang_at is not None and RANK == 1 and ATTEMPT < args.hang_attempts
beats = int(args.seconds * args.rate)
for n in range(beats):
    ft.heartbeat(n)
    if hangs and n == args.hang_at:
        (args.out / f"silent_since.attempt_{ATTEMPT}").write_text(repr(time.monotonic()))
        while True:
            time.sleep(3600)
    time.sleep(period)
