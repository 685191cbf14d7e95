"""The `mobc` command line: every command group is registered here, one module per group.

User errors (MobcError) print one clear message and exit 2; `--debug` shows the traceback.
Command modules import their heavy dependencies inside the commands, so `mobc --help` and
`mobc run` start without loading the compiler. `main` registers only the command the arguments
name (importing every command module cost `mobc run` ~0.15 s of its start); help, a missing or an
unknown command get them all.
"""

from __future__ import annotations

import importlib
import signal
import sys

import typer

from toolchain.cli.common import err, print_error
from toolchain.errors import Interrupted, MobcError

# command -> (module under toolchain.cli, function); group -> module holding its `app`
COMMANDS = {"compile": ("artifact", "compile_cmd"), "inspect": ("artifact", "inspect"),
            "verify": ("artifact", "verify"), "run": ("run", "run")}
GROUPS = {"bench": "bench", "train": "train", "eval": "evaluate", "adapter": "adapter", "hub": "hub",
          "bundle": "bundle"}
_state = {"debug": False}


def _root(debug: bool = typer.Option(False, "--debug", help="show full tracebacks for errors")) -> None:
    _state["debug"] = debug


def build_app(names: list[str] | None = None) -> typer.Typer:
    """The CLI with the named commands and groups registered (None: all of them, in help order)."""
    app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                      help="Compile Hugging Face LMs into verified NPU step graphs and decode them fast.")
    app.callback()(_root)
    for name in names if names is not None else [*COMMANDS, *GROUPS]:
        if name in COMMANDS:
            module, function = COMMANDS[name]
            app.command(name)(getattr(importlib.import_module(f"toolchain.cli.{module}"), function))
        else:
            app.add_typer(importlib.import_module(f"toolchain.cli.{GROUPS[name]}").app, name=name)
    return app


def invoked(argv: list[str]) -> list[str] | None:
    """The one command the arguments name (after the root options), or None for help or a name
    that is no command (the full CLI then lists them all)."""
    words = [a for a in argv if a != "--debug"]
    if not words or words[0] not in COMMANDS and words[0] not in GROUPS:
        return None
    return [words[0]]


def __getattr__(name: str) -> typer.Typer:
    if name == "app":  # the full CLI, built on first use (tests drive it through typer's runner)
        globals()["app"] = full = build_app()
        return full
    raise AttributeError(name)


def _on_signal(signum: int, frame: object) -> None:
    # a second Ctrl-C must not cut the cleanup short; SIGKILL still stops everything (and the next
    # compile sweeps what that leaves)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # an object the signal cut off mid-construction (CI caught one in zipfile.ZipFile.__init__) fails
    # in its __del__ when the unwound frames are freed; that is noise after an interrupt, not a bug
    sys.unraisablehook = lambda unraisable: None
    raise Interrupted(signum)


def main() -> None:
    # SIGTERM (timeout, CI cancellation) and SIGINT unwind as an exception, so staging folders,
    # locks and scratch space are removed on the way out (typer would swallow a KeyboardInterrupt)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        build_app(invoked(sys.argv[1:]))()
    except MobcError as exc:
        if _state["debug"]:
            raise
        print_error(str(exc))
        sys.exit(2)
    except Interrupted as exc:
        err.print(f"interrupted by {exc.name}: stopped, and removed what it had half written", markup=False,
                  highlight=False)
        sys.exit(128 + exc.signum)


if __name__ == "__main__":
    main()
