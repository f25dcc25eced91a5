"""A worker that waits for the test: it says it is up, waits (up to 300 s) until ``--go-file``
exists, prints ``--lines`` lines of about 200 bytes and exits 0. What happens around it in the
meantime (storage that dies, a disk that fills) is the test's."""

import argparse
import os
import time
from pathlib import Path

RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--go-file", type=Path, required=True)
    p.add_argument("--lines", type=int, default=0)
    p.add_argument("--pause", type=float, default=0.0, help="seconds between two lines")
    args = p.parse_args()
    print(f"rank {RANK} attempt {ATTEMPT} waits for {args.go_file}", flush=True)
    deadline = time.monotonic() + 300
    while not args.go_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    for i in range(args.lines):
        print(f"rank {RANK} line {i} " + "x" * 200, flush=True)
        time.sleep(args.pause)  # each line its own read of the pipe: a write of its own to the log
    print(f"rank {RANK} done", flush=True)


if __name__ == "__main__":
    main()
