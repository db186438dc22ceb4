"""The chat's niceness reaches its terminal session's autogroup, and is put back at exit."""

from __future__ import annotations

import pytest

from minibatch.tui import niceness


@pytest.fixture
def reniced(monkeypatch):
    calls = []
    monkeypatch.setattr(niceness.os, "nice", lambda n: calls.append(n) or n)  # the test process stays as it is
    return calls


def test_the_sessions_autogroup_is_niced_and_put_back(tmp_path, reniced):
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-25 nice 0\n")
    restore = niceness.be_nice(10, group)
    assert reniced == [10] and group.read_text() == "10"
    restore()
    assert group.read_text() == "0"


def test_a_session_already_as_nice_is_left_alone(tmp_path, reniced):
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-25 nice 15\n")
    restore = niceness.be_nice(10, group)
    restore()
    assert reniced == [10] and group.read_text() == "/autogroup-25 nice 15\n"


def test_without_autogroups_only_the_process_is_niced(tmp_path, reniced):
    niceness.be_nice(10, tmp_path / "absent")()
    assert reniced == [10] and not (tmp_path / "absent").exists()
