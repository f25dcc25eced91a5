"""The cooperative stop's rule and the step rate, with scripted readings and times."""

from launcher.core.stopping import STOP_PROPAGATION_S, StepRate, StopReading, local_stop_step, stop_step


def test_the_stop_step_lies_past_the_furthest_rank_by_the_fastest_pace():
    readings = [StopReading(True, 10, 5.0), StopReading(True, 7, 1.0)]
    assert stop_step(readings) == 10 + 2 + int(5.0 * STOP_PROPAGATION_S)


def test_no_stop_step_when_a_node_has_a_rank_that_never_listens():
    assert stop_step([StopReading(True, 10, 5.0), StopReading(False, 3, 1.0)]) == 0


def test_no_stop_step_before_any_rank_stepped_or_without_readings():
    assert stop_step([StopReading.idle(), StopReading.idle()]) == 0
    assert stop_step([]) == 0


def test_an_idle_node_holds_no_one_back():
    assert stop_step([StopReading(True, 4, 0.0), StopReading.idle()]) == 6


def test_one_node_alone_stops_at_the_step_after_next():
    assert local_stop_step(StopReading(True, 4, 100.0)) == 6
    assert local_stop_step(StopReading(False, 4, 100.0)) == 0


def test_the_step_rate_is_the_faster_of_the_recent_and_the_overall_pace():
    rate = StepRate()
    rate.observe(0.0, None)  # no step yet: nothing learned
    rate.observe(1.0, 0)
    rate.observe(1.1, 50)  # within the window: not yet measured
    assert rate.rate == 0.0
    rate.observe(2.0, 10)  # 10 steps in 1 s
    assert rate.rate == 10.0
    rate.observe(2.5, 40)  # 30 steps in 0.5 s recently: 60/s, faster than overall
    assert rate.rate == 60.0
    rate.observe(3.5, 40)  # stalled: recent 0, overall 40 steps in 2.5 s
    assert rate.rate == 16.0
