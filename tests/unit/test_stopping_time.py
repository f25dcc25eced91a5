"""The run's end's time on storage once a signal came (runs/storage_time.py, StoppingTime): its
waits, each at its own limit, end by one deadline, whatever storage does."""

from launcher.runs.storage_time import StoppingTime


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_storage_that_never_answers_gets_the_total_across_the_waits_and_no_more():
    clock = Clock()
    time_left = StoppingTime(10.0, clock)
    listing = time_left.limit(600.0, kept_back=1.0)  # --storage-timeout 10m
    clock.now += listing
    record = time_left.limit(5.0, kept_back=0.5)
    clock.now += record
    release = time_left.limit(5.0, kept_back=0.0)
    clock.now += release
    assert (listing, record, release) == (9.0, 0.5, 0.5)
    assert clock.now == 110.0


def test_storage_that_answers_leaves_the_later_waits_their_own_limits():
    clock = Clock()
    time_left = StoppingTime(10.0, clock)
    assert time_left.limit(20.0, kept_back=1.0) == 9.0
    clock.now += 0.3  # the listing answered
    assert time_left.limit(5.0, kept_back=0.5) == 5.0
    clock.now += 0.2
    assert time_left.limit(5.0, kept_back=0.0) == 5.0


def test_a_wait_past_the_deadline_gets_nothing_and_limits_are_tenths_rounded_down():
    clock = Clock()
    time_left = StoppingTime(10.0, clock)
    assert time_left.limit(3.0, kept_back=1.0) == 3.0  # the deadline starts at the first wait
    clock.now += 9.46
    assert time_left.limit(5.0, kept_back=0.0) == 0.5
    clock.now += 1.0
    assert time_left.limit(5.0, kept_back=0.0) == 0.0
