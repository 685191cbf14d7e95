"""The `mobc` command line: every command group is registered here, one module per group.

User errors (MobcError) print one clear message and exit 2; `--debug` shows the traceback.
Command modules import their heavy dependencies inside the commands, so `mobc --help` and
`mobc run` start without loading the compiler.
"""

from __future__ import annotations

import sys

import typer

from toolchain.cli import adapter, artifact, bench, evaluate, hub, run, train
from toolchain.cli.common import err
from toolchain.errors import MobcError

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


def main() -> None:
    try:
        app()
    except MobcError as exc:
        if _state["debug"]:
            raise
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("[red]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
