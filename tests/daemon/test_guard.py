"""Unit tests of the listener guard's parts: key comparison, key files, Host parsing, option checks, argv scrubbing."""

from __future__ import annotations

import hmac

import pytest

from minibatch.daemon import guard as guard_mod
from minibatch.daemon.cli import without_key
from minibatch.daemon.guard import Guard, GuardError, is_loopback, keys_match, split_host


def test_keys_match_compares_every_key_with_hmac_compare_digest(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(guard_mod.hmac, "compare_digest", spy)
    keys = ("first-key-123", "second-key-456", "third-key-789")
    assert keys_match("first-key-123", keys)
    # no early exit: a match on the first key still compares the other two
    assert [b for _, b in calls] == [k.encode() for k in keys]
    calls.clear()
    assert not keys_match("first-key-12", keys)
    assert not keys_match("", keys)
    assert not keys_match("FIRST-KEY-123", keys)
    assert len(calls) == 9  # three refusals, each against all three keys
    assert keys_match("third-key-789", keys)
    assert not keys_match("anything", ())


def test_key_file_one_key_per_line_comments_and_blanks_skipped(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# rotated 2026-11\n\nold-key-aaaa\n  new-key-bbbb  \n")
    f.chmod(0o600)
    g = Guard.from_options(api_key_file=f)
    assert g.api_keys == ("old-key-aaaa", "new-key-bbbb")
    f.write_text("# nothing\n")
    with pytest.raises(GuardError, match="holds no key"):
        Guard.from_options(api_key_file=f)
    with pytest.raises(GuardError, match="--api-key-file: cannot read"):
        Guard.from_options(api_key_file=tmp_path / "missing")


def test_key_file_is_reread_when_it_changes_and_a_bad_rewrite_keeps_the_old_keys(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("key-one-1111\n")
    g = Guard.from_options(api_key="flag-key-0000", api_key_file=f)
    assert g.api_keys == ("flag-key-0000", "key-one-1111")
    f.write_text("key-two-22222\n")
    g._checked_at = 0.0
    g.reload_keys()
    assert g.api_keys == ("flag-key-0000", "key-two-22222")
    f.write_text("\n")
    g._checked_at = 0.0
    g.reload_keys()
    assert g.api_keys == ("flag-key-0000", "key-two-22222")


def test_short_or_spaced_keys_are_refused_naming_the_flag():
    with pytest.raises(GuardError, match="--api-key: a key must be at least 8"):
        Guard.from_options(api_key="short")
    with pytest.raises(GuardError, match="--api-key"):
        Guard.from_options(api_key="has a space in it")


def test_non_loopback_host_needs_a_key_or_the_explicit_opt_out():
    with pytest.raises(GuardError, match="--host 0.0.0.0 .* --api-key .* --insecure-no-auth"):
        Guard.from_options(host="0.0.0.0", port=8000)
    with pytest.raises(GuardError, match="--host 192.168.1.5"):
        Guard.from_options(host="192.168.1.5", port=8000)
    assert Guard.from_options(host="0.0.0.0", port=8000, api_key="a-good-key-1").listen_host == "0.0.0.0"
    assert Guard.from_options(host="0.0.0.0", port=8000, insecure_no_auth=True).insecure_no_auth
    for host in (None, "127.0.0.1", "localhost", "::1", "127.0.0.2"):
        Guard.from_options(host=host, port=8000)
    # no --port: no TCP listener, --host alone opens nothing
    assert Guard.from_options(host="0.0.0.0").listen_host is None
    with pytest.raises(GuardError, match="--socket-requires-key needs a key"):
        Guard.from_options(socket_requires_key=True)


def test_host_header_parsing_and_loopback():
    assert split_host("Example.COM:8000") == "example.com"
    assert split_host("[::1]:8000") == "::1"
    assert split_host("127.0.0.1") == "127.0.0.1"
    assert split_host("[fe80::1]") == "fe80::1"
    assert is_loopback("127.0.0.1") and is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com") and not is_loopback("10.0.0.1")


def test_the_key_leaves_the_command_line():
    assert without_key(["start", "--api-key", "sekrit-123", "--port", "1"]) == (["start", "--port", "1"], "sekrit-123")
    assert without_key(["start", "--api-key=sekrit-123"]) == (["start"], "sekrit-123")
    assert without_key(["start", "--api-key-file", "/k"]) == (["start", "--api-key-file", "/k"], None)


def test_describe_never_shows_a_key(tmp_path):
    g = Guard.from_options(
        api_key="visible-if-leaked-1", host="127.0.0.1", port=8000, allowed_origins="http://app.example"
    )
    text = g.describe()
    assert "visible-if-leaked-1" not in text and "1 API key" in text and "http://app.example" in text
