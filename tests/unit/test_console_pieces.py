"""How a worker's output is cut into console lines (no process: the stream is fed by hand)."""

import io

from launcher.process.logs import _CONSOLE_PIECE, _Stream


def test_output_without_line_ends_reaches_the_console_in_pieces_of_at_most_4_kib():
    console, log = io.BytesIO(), io.BytesIO()
    stream = _Stream(-1, log, console, b"[0] ")
    data = b"x" * (65536 + 100)  # one read of a process that never writes a newline
    stream.take(data)
    stream.finish()
    lines = console.getvalue().split(b"\n")[:-1]
    assert all(len(line) <= len(b"[0] ") + _CONSOLE_PIECE for line in lines)
    assert b"".join(line[len(b"[0] ") :] for line in lines) == data
    assert log.getvalue() == data  # the log file gets every byte as is
