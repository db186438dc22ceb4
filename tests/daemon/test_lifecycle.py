"""minibatchd's lifecycle as a user meets it.

CLI start/status/stop, SIGTERM drain, SIGKILL, one instance, permissions.
"""

from __future__ import annotations

import os
import subprocess
import sys

from minibatch.daemon.paths import lock_path


def cli(*args, env=None, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "minibatch.daemon.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def test_cli_start_status_stop_in_the_background(tiny_chat_model_dir, short_tmp):
    old = os.umask(0o022)  # the usual umask: group and others could read what is made with it
    try:
        _start_status_stop(tiny_chat_model_dir, short_tmp)
    finally:
        os.umask(old)


def _start_status_stop(tiny_chat_model_dir, short_tmp):
    sock = short_tmp / "d.sock"
    env = {"MINIBATCH_LOG_FILE": str(short_tmp / "daemon.log"), "MINIBATCH_KV_CACHE_GB": "0.05"}
    started = cli("start", "--socket", str(sock), "--model", str(tiny_chat_model_dir), "--mode", "static", env=env)
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip().splitlines()[-1] == str(sock)
    try:
        status = cli("status", "--socket", str(sock))
        assert status.returncode == 0, status.stdout
        assert "mode: static" in status.stdout and "running: 0 / 32" in status.stdout and "kv cache:" in status.stdout
        again = cli("start", "--socket", str(sock), "--model", str(tiny_chat_model_dir), env=env)
        assert again.returncode == 1 and "already running (pid" in again.stderr
        logs = cli("logs", "--log-file", str(short_tmp / "daemon.log"))
        assert "ready in" in logs.stdout
        # what it creates is its user's alone, whatever the umask: the socket, its lock file, the log
        for path in (sock, lock_path(sock), short_tmp / "daemon.log"):
            assert path.stat().st_mode & 0o077 == 0, (path, oct(path.stat().st_mode))
    finally:
        stopped = cli("stop", "--socket", str(sock))
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert not sock.exists() and not lock_path(sock).exists()
    assert cli("status", "--socket", str(sock)).returncode == 3


def test_start_failure_is_reported_with_the_reason(short_tmp):
    env = {"MINIBATCH_LOG_FILE": str(short_tmp / "daemon.log")}
    out = cli("start", "--socket", str(short_tmp / "d.sock"), "--model", "no-such-model", env=env)
    assert (
        out.returncode == 1 and "unknown model 'no-such-model'" in out.stderr and "exited with status 1" in out.stderr
    )


def test_start_refuses_speculative_options_out_of_range_naming_them(tiny_chat_model_dir, short_tmp):
    env = {"MINIBATCH_LOG_FILE": str(short_tmp / "daemon.log")}
    sock = str(short_tmp / "d.sock")
    out = cli("start", "--socket", sock, "--model", str(tiny_chat_model_dir), "--num-speculative-tokens", "0", env=env)
    assert out.returncode == 2 and "num_speculative_tokens must be an integer in [1, 16], got 0" in out.stderr
    out = cli("start", "--socket", sock, "--model", str(tiny_chat_model_dir), "--speculative", "eagle", env=env)
    assert out.returncode == 2 and "speculative must be one of off, ngram, draft, got 'eagle'" in out.stderr


def test_the_chats_history_is_its_users_alone(tmp_path):
    from minibatch.tui.history import History

    old = os.umask(0o022)
    try:
        History(tmp_path / "state" / "chat.sqlite3").close()
    finally:
        os.umask(old)
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "state" / "chat.sqlite3").stat().st_mode & 0o777 == 0o600


def test_start_refuses_a_kv_cache_type_it_cannot_keep_naming_the_option_and_the_types(tiny_chat_model_dir, short_tmp):
    env = {"MINIBATCH_LOG_FILE": str(short_tmp / "daemon.log"), "MINIBATCH_KV_CACHE_GB": "0.05"}
    sock = str(short_tmp / "d.sock")
    out = cli("start", "--socket", sock, "--model", str(tiny_chat_model_dir), "--kv-cache-type", "q3_k", env=env)
    assert out.returncode == 2 and (
        "kv_cache_type: 'q3_k' is not a KV cache type; the types are f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, "
        "iq4_nl" in out.stderr
    )
    # the tiny model's heads have 16 values: no Q8_0 block fits them (every block type's refusal is the same
    # check: tests/kernels/test_kv_types.py)
    out = cli("start", "--socket", sock, "--model", str(tiny_chat_model_dir), "--kv-cache-type", "f16,q8_0", env=env)
    assert out.returncode == 1 and "kv_cache_type f16,q8_0: q8_0 needs head_dim a multiple of 32" in out.stderr
    started = cli("start", "--socket", sock, "--model", str(tiny_chat_model_dir), "--kv-cache-type", "f16", env=env)
    assert started.returncode == 0, started.stderr
    try:
        status = cli("status", "--socket", sock)
        assert "f16, 256 B/token" in status.stdout, status.stdout  # 2 layers x 2 KV heads x 16 values x 2 x 2 bytes
    finally:
        cli("stop", "--socket", sock)
