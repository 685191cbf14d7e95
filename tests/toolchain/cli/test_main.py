"""`mobc`'s entry point registers only the command its arguments name (a `mobc run` start does not
import the other command modules), and every command where none or an unknown one is named."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli_main import run_main
from toolchain.cli.main import COMMANDS, GROUPS, build_app, invoked


@pytest.mark.parametrize(("argv", "names"), [
    (["run", "ART", "--prompt", "x"], ["run"]),
    (["--debug", "bench", "decode"], ["bench"]),
    (["compile", "r.yaml"], ["compile"]),
    ([], None),
    (["--help"], None),
    (["nope"], None),
])
def test_invoked_names_the_command(argv, names):
    assert invoked(argv) == names


def test_the_full_cli_has_every_command():
    import typer.main

    names = set(typer.main.get_command(build_app()).commands)
    assert names == set(COMMANDS) | set(GROUPS)


def test_help_and_an_unknown_command_list_every_command():
    help_text = run_main("--help").out
    assert all(name in help_text for name in [*COMMANDS, *GROUPS])
    unknown = run_main("nope")
    assert unknown.code == 2 and "No such command" in unknown.err


def test_run_imports_no_other_command_module(tmp_path):
    # a missing artifact: `mobc run` stops at its clear error, after its whole CLI start
    code = ("import sys; sys.argv = ['mobc', 'run', {!r}, '--prompt', 'x']\n"
            "from toolchain.cli.main import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('toolchain.cli.')))").format(str(tmp_path / "none"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out.strip().splitlines()[-1])
    assert "toolchain.cli.run" in loaded
    others = {f"toolchain.cli.{m}" for m in {*GROUPS.values(), "artifact"}}
    assert not others & set(loaded), loaded


def test_an_interrupt_inside_a_half_built_object_prints_one_line():
    # SIGTERM landing inside a constructor (CI caught one in zipfile.ZipFile.__init__) leaves an object
    # whose __del__ fails when the unwound frames are freed; Python would print that as a traceback
    code = ("import os, signal, sys\n"
            "import toolchain.cli.main as m\n"
            "class HalfBuilt:\n"
            "    def __init__(self):\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        self.ready = True\n"
            "    def __del__(self):\n"
            "        self.ready\n"
            "def command():\n"
            "    half = HalfBuilt()\n"
            "m.build_app = lambda names: command\n"
            "m.main()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 128 + 15
    assert proc.stderr.strip() == "interrupted by SIGTERM: stopped, and removed what it had half written"
