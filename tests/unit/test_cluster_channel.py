"""The nodes' attempt channel over an in-process store (torch's HashStore): node 0's and a
follower's ends in one process, time and signals real but short."""

import signal
import threading
import time

import pytest
from helpers import until
from torch.distributed import HashStore

from launcher.cluster.channel import ChannelSpec
from launcher.cluster.deadline_store import DeadlineStore, StoreTimeout
from launcher.cluster.follower_channel import FollowerChannel
from launcher.cluster.leader_channel import LeaderChannel
from launcher.cluster.rendezvous import LeaderUnreachable, RoundFailed
from launcher.cluster.wire import (
    Interrupt,
    InterruptKind,
    JobVerdict,
    NodeInfo,
    NodeReport,
    RoundPlan,
    plan_problem,
)
from launcher.core.outcomes import AttemptOutcome, RunStatus
from launcher.core.stopping import StopReading
from launcher.grammar.errors import SignalReceived

TIMEOUT = 0.6  # --node-timeout, in seconds


class Inbox:
    """The supervisor's signal inbox as the channel uses it: signals received so far, and a
    short sleep (a real SignalInbox needs the main thread's handlers)."""

    def __init__(self, *received: int, answered: int = 0) -> None:
        self.received = list(received)
        self.answered = answered  # how many of them the attempt stopped its ranks for

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def wake(self) -> None:
        pass

    def name(self, index: int) -> str:
        return signal.Signals(self.received[index]).name


def _ends(store, node: int, inbox=None):
    spec = ChannelSpec(node, 2, TIMEOUT, "127.0.0.1:0")
    kind = LeaderChannel if node == 0 else FollowerChannel
    return kind(store, spec, inbox or Inbox())


def _info(node: int) -> NodeInfo:
    return NodeInfo(node, "host", 100 + node, 1, ["train.py"])


def _met(store, leader_inbox=None, follower_inbox=None):
    """Node 0's and node 1's ends once both announced themselves and node 0 read them (every
    attempt begins so: node 0 watches only the nodes that came)."""
    leader, follower = _ends(store, 0, leader_inbox), _ends(store, 1, follower_inbox)
    leader.announce(_info(0)), follower.announce(_info(1))
    leader.node_infos(2, limit=5.0)
    return leader, follower


@pytest.fixture
def store():
    return HashStore()


def test_a_follower_lost_after_the_attempt_was_interrupted_is_still_found(store):
    """The many-node deadlock: node 0's rank failed first (an interrupt is in force), then the
    follower's supervisor died before it reported. gather must end, with the follower lost."""
    leader, follower = _met(store)
    leader.interrupt(Interrupt(0, InterruptKind.FAILURE, "rank 0 failed"))
    leader.report(NodeReport(0, "FAILED", [], False, None))
    follower.close()  # its liveness counter stops: a kill -9 of its supervisor
    started = time.monotonic()
    reports = leader.gather(limit=30)
    assert time.monotonic() - started < 10 * TIMEOUT
    assert [r.node for r in reports] == [0]
    assert [f.node for f in leader.lost_failures()] == [1]
    leader.close()


def test_tick_keeps_looking_for_lost_nodes_once_interrupted(store):
    leader, follower = _met(store)
    follower.interrupt(Interrupt(1, InterruptKind.FAILURE, "rank 1 failed"))
    # Pushed: node 0's watching thread wakes on the set, some time after it (a bounded wait)
    deadline = time.monotonic() + 10 * TIMEOUT
    while (seen := leader.tick()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen is not None and seen.node == 1
    follower.close()
    deadline = time.monotonic() + 10 * TIMEOUT
    while not leader.lost_failures() and time.monotonic() < deadline:
        assert leader.tick().node == 1  # the first interrupt stays the one in force
        time.sleep(0.05)
    assert [f.node for f in leader.lost_failures()] == [1]
    leader.close()


class Counted:
    """A store that counts the calls made through it (a clone, the watch's own connection, not)."""

    def __init__(self, store) -> None:
        self._store, self.calls = store, []

    def __getattr__(self, method: str):
        call = getattr(self._store, method)
        if method == "clone":
            return call

        def counted(*args):
            self.calls.append(method)
            return call(*args)

        return counted


def test_an_interrupt_pushed_to_a_node_is_acted_on_without_another_call_to_node_0s_store(store):
    """The woken node asks node 0's store nothing more on the turn it sees the interrupt (node 0's
    store is then busy answering every other woken node): its look for a lost node 0 waits."""
    counted = Counted(store)
    leader = _ends(store, 0)
    follower = FollowerChannel(counted, ChannelSpec(1, 2, TIMEOUT, "127.0.0.1:0"), Inbox())
    leader.announce(_info(0)), follower.announce(_info(1))
    leader.node_infos(2, limit=5.0)
    assert follower.tick() is None
    until(lambda: time.monotonic() >= follower._next_look)  # a look for a lost node 0 is due
    leader.interrupt(Interrupt(0, InterruptKind.FAILURE, "rank 0 failed"))
    until(lambda: follower._watch.fired, timeout=10 * TIMEOUT)
    before = len(counted.calls)
    assert follower.tick().node == 0
    assert counted.calls[before:] == []
    looked = []
    follower._look_for_lost_nodes = lambda: looked.append(1)  # type: ignore[method-assign]
    follower.tick()  # the turn after: the look for a lost node 0 goes on
    assert looked, "the follower no longer looks for a lost node 0"
    follower.close(), leader.close()


def test_a_node_that_beats_but_never_reports_is_lost_at_the_report_deadline(store):
    leader, follower = _met(store)
    leader.report(NodeReport(0, "SUCCEEDED", [], False, None))
    assert [r.node for r in leader.gather(limit=0.5)] == [0]
    (lost,) = leader.lost_failures()
    assert lost.node == 1
    # Its counter moved all along: "no sign of life for 0.2 s" would be false.
    said = lost.describe()
    assert "lost: no report within 0.5 s of the attempt's end, though its supervisor answered" in said
    assert "no sign of life" not in lost.describe()
    leader.close(), follower.close()


def test_a_signal_ends_node_0s_wait_for_reports(store):
    inbox = Inbox()
    leader, follower = _met(store, leader_inbox=inbox)
    threading.Timer(0.2, lambda: inbox.received.append(15)).start()
    started = time.monotonic()
    assert leader.gather(limit=30) == []
    assert time.monotonic() - started < 5
    leader.close(), follower.close()


def test_a_signal_that_came_before_node_0_began_to_wait_for_reports_ends_the_wait(store):
    """The CI failure: node 0's rank failed (its peer's supervisor was killed), and SIGTERM came
    while node 0 stopped its ranks, before gather began. No one acted on it: gather must not
    wait out the follower's --node-timeout for it."""
    leader, follower = _met(store, leader_inbox=Inbox(15))
    started = time.monotonic()
    assert leader.gather(limit=30) == []
    assert time.monotonic() - started < 1
    leader.close(), follower.close()


def test_a_signal_the_attempt_stopped_for_leaves_node_0_waiting_for_the_reports(store):
    """A preemption: every node stops at the agreed step and reports; node 0 waits for them."""
    leader, follower = _met(store, leader_inbox=Inbox(15, answered=1))
    leader.report(NodeReport(0, "PREEMPTED", [], True, 7))
    threading.Timer(0.3, lambda: follower.report(NodeReport(1, "PREEMPTED", [], True, 7))).start()
    assert [r.node for r in leader.gather(limit=30)] == [0, 1]
    leader.close(), follower.close()


def test_the_verdict_reaches_the_follower_and_is_acknowledged(store):
    leader, follower = _met(store)
    verdict = JobVerdict.end(0, RunStatus.SUCCEEDED, "every rank exited 0", AttemptOutcome.SUCCEEDED, [])
    leader.publish_verdict(verdict)
    assert follower.await_verdict(limit=5) == verdict
    started = time.monotonic()
    leader.await_acks()
    assert time.monotonic() - started < TIMEOUT
    leader.close(), follower.close()


def test_node_0_does_not_wait_for_the_ack_of_a_node_whose_supervisor_is_gone(store):
    leader, follower = _met(store)
    follower.close()
    leader.publish_verdict(
        JobVerdict.end(143, RunStatus.PREEMPTED, "interrupted by SIGTERM", AttemptOutcome.FAILED, [])
    )
    started = time.monotonic()
    leader.await_acks()  # the ack deadline is --node-timeout; a silent node is given up earlier
    assert time.monotonic() - started < 5
    leader.close()


def test_a_follower_waiting_for_the_verdict_answers_a_signal(store):
    inbox = Inbox()
    leader, follower = _met(store, follower_inbox=inbox)
    threading.Timer(0.2, lambda: inbox.received.append(2)).start()
    with pytest.raises(SignalReceived):
        follower.await_verdict(limit=30)
    leader.close(), follower.close()


def test_a_follower_leaves_at_once_for_a_signal_it_did_not_stop_for(store):
    leader, follower = _met(store, follower_inbox=Inbox(2))
    with pytest.raises(SignalReceived):
        follower.await_verdict(limit=30)
    leader.close(), follower.close()


class Freezable:
    """A store whose calls block once ``freeze`` is called (node 0's process stopped: its socket
    still accepts), until ``thaw``."""

    def __init__(self, store) -> None:
        self._store, self._running = store, threading.Event()
        self._running.set()

    def freeze(self) -> None:
        self._running.clear()

    def thaw(self) -> None:
        self._running.set()

    def __getattr__(self, method: str):
        call = getattr(self._store, method)

        def blocking(*args):
            self._running.wait()
            return call(*args)

        return blocking


def test_a_follower_whose_node_0_falls_silent_loses_it(store):
    frozen = Freezable(store)
    leader = _ends(store, 0)
    follower = FollowerChannel(frozen, ChannelSpec(1, 2, TIMEOUT, "127.0.0.1:0"), Inbox())
    leader.announce(_info(0)), follower.announce(_info(1))
    leader.node_infos(2, limit=5.0)
    frozen.freeze()  # node 0 stopped: its store answers nothing, its counter stands still
    started = time.monotonic()
    try:
        with pytest.raises(LeaderUnreachable, match="no answer within 0.6 s|--node-timeout"):
            follower.await_verdict(limit=30)
        assert time.monotonic() - started < 10 * TIMEOUT
    finally:
        frozen.thaw()
    leader.close(), follower.close()


def test_a_follower_hears_node_0_through_its_own_beats(store):
    """Issue 48 item 8: a follower looked at node 0's counter every beat, a request a second per
    node; node 0 hosts the store its own beats go to, so an answered beat is node 0 heard. A
    node 0 whose counter stands still but whose store answers (its process runs) is not lost."""
    leader, follower = _met(store)
    leader._beater.stop()  # node 0's counter stands still; its store still answers
    beats = int(TIMEOUT / follower._beater.every) + 3  # more than --node-timeout's worth of beats
    until(lambda: follower.tick() is None and int(store.add("alive/1", 0)) >= beats, 30 * TIMEOUT, 0.05)
    assert follower.tick() is None
    leader.close(), follower.close()


def test_every_node_computes_the_same_stop_step(store):
    leader, follower = _met(store)
    steps = {}
    thread = threading.Thread(
        target=lambda: steps.update(f=follower.agree_stop_step(StopReading(True, 9, 0.0)))
    )
    thread.start()
    steps["l"] = leader.agree_stop_step(StopReading(True, 12, 1.0))
    thread.join(5)
    assert steps == {"l": 12 + 2 + 2, "f": 16}
    leader.close(), follower.close()


def test_a_store_call_that_never_returns_ends_at_its_deadline():
    """torch's TCPStore client waits with no end on a stopped server's socket."""
    release = threading.Event()

    class Stopped:
        def add(self, key, value):
            release.wait(30)
            return 0

    store = DeadlineStore(Stopped(), timeout=0.2)
    with pytest.raises(StoreTimeout):
        store.add("alive/0", 0)
    with pytest.raises(StoreTimeout):  # the stuck call still holds it: given up at once
        store.add("alive/0", 0)
    release.set()
    store.close()


def test_node_0_plans_only_when_every_node_of_the_round_announced_itself(store):
    leader, follower = _ends(store, 0), _ends(store, 1)
    leader.announce(_info(0))
    with pytest.raises(RoundFailed, match="1 of the round's 2 nodes did not announce itself"):
        leader.node_infos(2, limit=0.3)  # the follower joined the round and died: never fewer nodes
    follower.announce(_info(1))
    assert sorted(leader.node_infos(2, limit=0.3)) == [0, 1]
    leader.close(), follower.close()


def test_nothing_is_sized_by_the_largest_job_a_node_could_join(store):
    """--nnodes 2:1000000000: node 0 watches and reads only the nodes that came (issue 33)."""
    spec = ChannelSpec(0, 10**9, TIMEOUT, "127.0.0.1:0")
    leader = LeaderChannel(store, spec, Inbox())
    leader.announce(_info(0))
    FollowerChannel(store, ChannelSpec(5, 10**9, TIMEOUT, "127.0.0.1:0"), Inbox()).announce(_info(5))
    assert sorted(leader.node_infos(2, limit=0.3)) == [0, 5]
    assert [row.node for row in leader.job_progress([])[1]] == [0, 5]
    leader.close()


@pytest.mark.parametrize(
    "plan, fewest, problem",
    [
        (RoundPlan(3, "a", 1, [0, 1], world_size=4), 2, ""),
        (RoundPlan(3, "a", 1, [1], world_size=2), 2, "planned attempt 3 on 1 node(s) [1]: --nnodes 2 asks"),
        (
            RoundPlan(3, "a", 1, [0, 1], world_size=2),
            2,
            "at WORLD_SIZE 2, but 2 node(s) x --nproc 2 make 4",
        ),
        (RoundPlan(3, "a", 1, [0, 2], world_size=4), 2, "leaves out node 1"),
        (RoundPlan(3, "a", 1, [1, 1], world_size=4), 2, "names impossible nodes [1, 1]"),
        (RoundPlan(3, "a", 1, [1, 5], world_size=4), 1, "names impossible nodes [1, 5] (--nnodes 1:2)"),
        (RoundPlan(3, "a", 1, [1], world_size=2), 1, ""),  # an elastic job at its fewest nodes
    ],
)
def test_a_node_refuses_a_plan_that_is_not_a_whole_job(plan, fewest, problem):
    found = plan_problem(plan, node=1, nproc=2, fewest=fewest, nnodes=2)
    assert (problem in found and bool(found)) if problem else found == ""


def test_a_nodes_own_first_signal_during_the_agreement_is_the_same_request(store):
    """SLURM signals every node at once: node 1 is agreeing on the stop step node 0 asked for when
    its own SIGUSR1 arrives. That one must not end the agreement: node 1's ranks would not be told
    the step, and node 0's would wait for them in a collective."""
    inbox = Inbox()
    leader, follower = _met(store, follower_inbox=inbox)
    steps = {}
    thread = threading.Thread(
        target=lambda: steps.update(f=follower.agree_stop_step(StopReading(True, 9, 0.0)))
    )
    thread.start()
    until(lambda: store.check(["stop/1"]))  # node 1 has said its reading and waits for node 0's
    inbox.received.append(signal.SIGUSR1)
    steps["l"] = leader.agree_stop_step(StopReading(True, 12, 1.0))
    thread.join(5)
    assert steps == {"l": 16, "f": 16}
    leader.close(), follower.close()


def test_a_second_signal_during_the_agreement_ends_it(store):
    """Ctrl+C again: now. Node 0 never answers here and node 1 would wait its whole --node-timeout
    (an hour): it returns at once, with no step."""
    inbox = Inbox()
    follower = FollowerChannel(store, ChannelSpec(1, 2, 3600.0, "127.0.0.1:0"), inbox)
    steps = {}
    thread = threading.Thread(
        target=lambda: steps.update(f=follower.agree_stop_step(StopReading(True, 9, 0.0)))
    )
    thread.start()
    until(lambda: store.check(["stop/1"]))
    inbox.received += [signal.SIGUSR1, signal.SIGINT]
    thread.join(5)
    assert not thread.is_alive() and steps == {"f": 0}
    follower.close()


def test_a_damaged_progress_share_is_said_once_and_its_node_shows_no_ranks(store, caplog):
    """Node 0 once raised KeyError on a share without "at", ending its attempt loop."""
    from launcher.core.beats import ProgressRow

    leader, follower = _met(store)
    follower.share_progress([ProgressRow(0, 7, 3, 0.5, "stepping")])
    assert [(r.node, r.rank, r.step) for r in leader.job_progress([])[0]] == [(1, 0, 3)]
    for damaged in ('{"rows": []}', '{"at": NaN, "rows": []}', "[]", '{"at": 1e9, "rows": [{"rank": 0}]}'):
        store.set("progress/1", damaged)  # a foreign writer, a fault
        ranks, nodes = leader.job_progress([])
        assert ranks == [] and [n.node for n in nodes] == [0, 1]
    said = [r.message for r in caplog.records if "progress share" in r.message]
    assert said == ["node 1's progress share is damaged (at is missing); its ranks are left out"]
    leader.close(), follower.close()


def test_a_follower_beats_once_and_node_0_watches_its_claim_s_counter(store):
    """Issue 48 item 8: a follower beat twice, its claim's counter in the lobby and one in the
    attempt's keys, each a request to node 0's store every beat. Its one beat is the claim's,
    and node 0 judges it by that: alive while the claim beats, lost once it stops."""
    from launcher.cluster.lobby import Hello, NodeClaim

    job = HashStore()  # the job's store, where the lobby's keys are (the attempt's: ``store``)
    claim = NodeClaim(1, Hello(1, "host", 101, "job", ["train.py"]), node_timeout=TIMEOUT)
    claim.take(job, job, Inbox())
    leader = LeaderChannel(store, ChannelSpec(0, 2, TIMEOUT, "127.0.0.1:0"), Inbox(), job_store=job)
    follower = FollowerChannel(store, ChannelSpec(1, 2, TIMEOUT, "127.0.0.1:0"), Inbox(), beater=claim.beater)
    leader.announce(_info(0)), follower.announce(_info(1))
    leader.node_infos(2, limit=5.0)
    counter = f"lobby/alive/{claim.token}"
    beats = int(TIMEOUT / claim.beater.every) + 3  # more than --node-timeout's worth of beats

    def beaten_and_not_lost() -> bool:
        assert leader.tick() is None, leader.tick()  # alive: its claim's counter moves
        return int(job.add(counter, 0)) >= beats

    until(beaten_and_not_lost, timeout=30 * TIMEOUT, look=0.05)
    assert int(store.add("alive/1", 0)) == 0  # no second beat in the attempt's keys
    claim.release()  # a kill -9 of its supervisor: its one beat stops
    lost = until(leader.tick, timeout=10 * TIMEOUT, look=0.05)
    assert lost.kind is InterruptKind.LOST and "node 1" in lost.detail, lost
    leader.close(), follower.close()


def test_a_follower_shares_its_ranks_rows_only_when_they_say_something_new(store):
    """Issue 48 item 8: rows that only grew older were sent to node 0 every 5 s; node 0 ages a
    share's rows from its time, so the same rows are not sent again. A new step, or a beat
    (the silence began anew), is."""
    from launcher.core.beats import ProgressRow

    counted = Counted(store)
    follower = FollowerChannel(counted, ChannelSpec(1, 2, TIMEOUT, "127.0.0.1:0"), Inbox())
    began = time.time() - 2.0

    def rows(step: int, silent_since: float):
        return [ProgressRow(4, 1234, step, time.time() - silent_since, "running")]

    def sets() -> int:
        return counted.calls.count("set")

    follower.share_progress(rows(7, began))
    assert sets() == 1
    follower.share_progress(rows(7, began))  # only older: nothing new to say
    assert sets() == 1
    follower.share_progress(rows(8, began))  # a new step
    assert sets() == 2
    follower.share_progress(rows(8, time.time()))  # a beat: its silence began again
    assert sets() == 3
    follower.close()
