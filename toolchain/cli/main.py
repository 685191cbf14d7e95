"""The `mobc` command line: every command group is registered here, one module per group.

User errors (MobcError) print one clear message and exit 2; `--debug` shows the traceback.
Command modules import their heavy dependencies inside the commands, so `mobc --help` and
`mobc run` start without loading the compiler.
"""

from __future__ import annotations

import signal
import sys

import typer

from toolchain.cli import adapter, artifact, bench, bundle, evaluate, hub, run, train
from toolchain.cli.common import err, print_error
from toolchain.errors import Interrupted, MobcError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Compile Hugging Face LMs into verified NPU step graphs and decode them fast.")
_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="show full tracebacks for errors")) -> None:
    _state["debug"] = debug


app.command("compile")(artifact.compile_cmd)
app.command("inspect")(artifact.inspect)
app.command("verify")(artifact.verify)
app.command("run")(run.run)
app.add_typer(bench.app, name="bench")
app.add_typer(train.app, name="train")
app.add_typer(evaluate.app, name="eval")
app.add_typer(adapter.app, name="adapter")
app.add_typer(hub.app, name="hub")
app.add_typer(bundle.app, name="bundle")


def _on_signal(signum: int, frame: object) -> None:
    # a second Ctrl-C must not cut the cleanup short; SIGKILL still stops everything (and the next
    # compile sweeps what that leaves)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


def main() -> None:
    # SIGTERM (timeout, CI cancellation) and SIGINT unwind as an exception, so staging folders,
    # locks and scratch space are removed on the way out (typer would swallow a KeyboardInterrupt)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        app()
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
