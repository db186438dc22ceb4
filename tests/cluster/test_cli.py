"""minibatch-serve's options: bad values are refused before anything starts, naming the option."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="the cluster extra is not installed")

from minibatch.daemon.cluster.cli import parse_autoscale  # noqa: E402


def test_autoscale_takes_min_colon_max():
    assert parse_autoscale("1:4") == (1, 4) and parse_autoscale(None) is None
    for bad in ("4", "a:b", "3:1", "0:2", "1:2:3"):
        with pytest.raises(ValueError, match="--autoscale"):
            parse_autoscale(bad)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--autoscale", "3:1"], "--autoscale: need 0 < MIN <= MAX"),
        (["--replicas", "0"], "--replicas: must be at least 1"),
        (["--routing", "random"], "--routing: must be prefix or least-loaded"),
        (["--spill-threshold", "-1"], "--spill-threshold: must be >= 0"),
        (["--media-path", "/no/such/folder"], "--media-path: /no/such/folder is not a folder"),
        (["--reasoning-format", "hidden"], "--reasoning-format: must be auto or none"),
    ],
)
def test_start_refuses_bad_options_before_starting(args, message, short_tmp):
    out = subprocess.run(
        [sys.executable, "-m", "minibatch.daemon.cluster.cli", "start", "--socket", str(short_tmp / "s.sock"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not (short_tmp / "s.sock.lock").exists()


def test_status_and_stop_say_when_nothing_runs(short_tmp):
    for cmd, code in (("status", 3), ("stop", 1)):
        out = subprocess.run(
            [sys.executable, "-m", "minibatch.daemon.cluster.cli", cmd, "--socket", str(short_tmp / "s.sock")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == code and "minibatch-serve: not running" in out.stdout + out.stderr


def test_the_replicas_daemons_get_the_daemons_own_settings(tmp_path):
    """--media-path, --reasoning-format and --reasoning-budget reach each replica's daemon (ClusterConfig)."""
    from minibatch.daemon.cluster.cli import build_parser, cluster_config

    args = build_parser().parse_args(
        ["start", "--media-path", str(tmp_path), "--reasoning-format", "none", "--reasoning-budget", "64"]
    )
    conf = cluster_config(args, tmp_path / "s.sock")
    assert (conf.media_path, conf.reasoning_format, conf.reasoning_budget) == (str(tmp_path.resolve()), "none", 64)
