"""The installed distribution: subpackages under `minibatch`, no stray top-level modules, console scripts."""

from __future__ import annotations

import shutil
import subprocess
import sys

SUBPACKAGES = [
    "minibatch.engine",
    "minibatch.engine.attention",
    "minibatch.engine.core",
    "minibatch.engine.core.policies",
    "minibatch.engine.gguf",
    "minibatch.engine.models",
    "minibatch.engine.runner",
    "minibatch.engine.store",
    "minibatch.engine.testing",
    "minibatch.engine.text",
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
        "import minibatch.engine.store.cache, minibatch.engine.testing.greedy\n"
        "bad = [m for m in ('aiohttp', 'textual') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_wheel_holds_every_package_folder(tmp_path):
    """pyproject.toml lists the packages by hand: a folder left out would be missing from the wheel."""
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    folders = {
        "engine": "minibatch.engine",
        "daemon": "minibatch.daemon",
        "tui": "minibatch.tui",
        "kernels": "minibatch.kernels",
    }
    for folder in folders:
        shutil.copytree(root / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "build*"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "w"),
            ".",
        ],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "w").glob("minibatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "/".join((folders[folder].replace(".", "/"), *init.relative_to(src / folder).parent.parts, "__init__.py"))
        for folder in folders
        for init in (src / folder).rglob("__init__.py")
    }
    assert len(expected) >= 15 and "minibatch/engine/core/policies/__init__.py" in expected
    assert expected - names == set(), f"package folders missing from the wheel: {sorted(expected - names)}"
    assert "minibatch/kernels/cpu/csrc/quant_dot.cpp" in names and "minibatch/tui/app.tcss" in names
