"""The child process of `mobc bench startup`: one `mobc run ... --max-new-tokens 1` in a mode.

It lives in the CLI layer because it calls the CLI's entry point (toolchain.bench.startup only
starts it by module name, so the bench layer never imports the CLI).
"""

from __future__ import annotations

import sys


def run_child(mode: str, artifact: str, prompt: str) -> None:
    from toolchain.artifact import integrity

    if mode == "unchecked":  # the baseline: the integrity check is a no-op in this process only
        integrity.check_files = lambda folder, manifest: None
    from toolchain.cli.main import main

    sys.argv = ["mobc", "run", artifact, "--prompt", prompt, "--max-new-tokens", "1"]
    main()


if __name__ == "__main__":
    run_child(*sys.argv[1:4])
