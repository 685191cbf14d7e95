"""The real `mobc` entry point (toolchain.cli.main.main) in-process: exit code, stdout and stderr exactly
as a user sees them (CliRunner bypasses main(), so it shows neither the exit code 2 of a MobcError nor
how the message is printed), without paying a subprocess's start-up for every case."""

from __future__ import annotations

import contextlib
import io
import signal
import sys
import traceback
from dataclasses import dataclass


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def clean_error(self) -> bool:
        """Exit 2 with one `error:` message and no traceback."""
        return self.code == 2 and "Traceback" not in self.err and self.err.count("error:") == 1


def run_main(*args: str) -> Run:
    from toolchain.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    argv = sys.argv
    sys.argv = ["mobc", *map(str, args)]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:  # what the console script would show as a traceback with exit code 1
        code = 1
        err.write(traceback.format_exc())
    finally:
        sys.argv = argv
        for s, h in handlers.items():
            signal.signal(s, h)
    return Run(code, out.getvalue(), err.getvalue())
