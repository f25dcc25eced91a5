"""The step loop of the test scripts, with ``--until-attempt``: a test that stops an attempt
itself (kills a node, signals ftlaunch, waits for a node to join) must never race the end of that
attempt's training. In an attempt before ``until_attempt`` the steps go on past ``stop`` until the
attempt is stopped from outside, for five minutes at most."""

import time
from typing import Iterator

_LONGEST_S = 300.0


def add_option(parser) -> None:
    parser.add_argument(
        "--until-attempt",
        type=int,
        default=0,
        help="in attempts before this one, step on past --steps until stopped (up to 300 s)",
    )


def steps(start: int, stop: int, attempt: int, until_attempt: int) -> Iterator[int]:
    waiting = attempt < until_attempt
    deadline = time.monotonic() + _LONGEST_S
    step = start
    while step < stop or (waiting and time.monotonic() < deadline):
        yield step
        step += 1
    if waiting:
        raise SystemExit(f"attempt {attempt} was not stopped within {_LONGEST_S:g} s (--until-attempt)")
