"""The installed distribution: subpackages under `minibatch`, no stray top-level modules, console scripts."""

from __future__ import annotations

import shutil
import subprocess
import sys

SUBPACKAGES = [
    "minibatch.engine",
    "minibatch.engine.models",
    "minibatch.engine.weights",
    "minibatch.kernels",
    "minibatch.daemon",
    "minibatch.tui",
    "minibatch.tui.widgets",
    "minibatch.tui.screens",
]


def test_subpackages_import_and_no_top_level_names_leak(tmp_path):
    # Run from an unrelated directory so the checkout itself is not on sys.path.
    code = (
        "import importlib, importlib.util\n"
        f"for name in {SUBPACKAGES!r}: importlib.import_module(name)\n"
        "leaked = [n for n in ('engine', 'daemon', 'tui', 'kernels') if importlib.util.find_spec(n)]\n"
        "assert not leaked, leaked\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_console_scripts_are_installed():
    bindir = __import__("pathlib").Path(sys.executable).parent
    for script in ("minibatchd", "minibatch-chat"):
        assert (bindir / script).exists() or shutil.which(script), script


def test_tui_speaks_only_the_socket_protocol(tmp_path):
    code = (
        "import sys\n"
        "import minibatch.tui.app, minibatch.tui.cli\n"
        "bad = [m for m in sys.modules if m.startswith('minibatch.engine') or m in ('torch', 'transformers')]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_engine_core_imports_no_web_or_ui_framework(tmp_path):
    code = (
        "import sys\n"
        "import minibatch.engine.model_store, minibatch.engine.greedy\n"
        "bad = [m for m in ('aiohttp', 'textual') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
