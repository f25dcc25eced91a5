"""The periodic look for descendants' own process groups: walked again only when the kernel
handed out a pid since the last walk (issue 48 item 8: a healthy group's look re-read every
thread's children file twice a second, a third of node 0's read calls)."""

import threading

from launcher.process.tree import DescendantLook, last_pid


def test_the_walk_is_not_repeated_while_no_pid_was_handed_out():
    cursor, walks = [100], []

    def walk():
        walks.append(cursor[0])
        return [7, 8]

    look = DescendantLook(walk, last_pid=lambda: cursor[0])
    assert look() == [7, 8] and look() == [7, 8] and look() == [7, 8]
    assert len(walks) == 1  # nothing was born: the first walk's pids are still the whole tree
    cursor[0] = 101  # a process or a thread was made somewhere
    look()
    assert len(walks) == 2
    look()
    assert len(walks) == 2


def test_without_the_kernel_s_last_pid_every_look_walks():
    walks = []
    look = DescendantLook(lambda: walks.append(1) or [], last_pid=lambda: None)
    look()
    look()
    assert len(walks) == 2


def test_the_kernel_s_last_pid_moves_with_a_new_thread():
    before = last_pid()
    assert before is not None  # Linux with /proc/sys: where ftlaunch runs
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    assert last_pid() != before
