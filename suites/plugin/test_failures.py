"""The failure message kept in run files (pytest_rlk.failures), as plain functions."""
from __future__ import annotations

from pytest_rlk.failures import failure_message


def test_crash_line_first_then_the_tail():
    text = "\n".join(f"line {i}" for i in range(100)) + "\nE   ValueError: bad shape"
    msg = failure_message("ValueError: bad shape", text, tail_lines=40)
    lines = msg.splitlines()
    assert lines[0] == "ValueError: bad shape"
    assert lines[1] == "[... 61 lines cut ...]"
    assert lines[2] == "line 61" and lines[-1] == "E   ValueError: bad shape"


def test_long_message_is_capped_keeping_the_end():
    text = "x" * 10_000 + "\nE   the real error"
    msg = failure_message("crash " * 2000, text, max_chars=1000)
    assert len(msg) <= 1000
    assert msg.startswith("crash crash") and msg.endswith("E   the real error")


def test_no_crash_line():
    assert failure_message(None, "only the report\n") == "only the report"
    assert failure_message("just a crash", "") == "just a crash"
