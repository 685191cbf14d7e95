"""One file written whole or not at all: the shared tmp-then-rename of every single-file writer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yields a hidden path beside `path` (.NAME.writing-PID) for the block to write; when the block ends
    without error it is renamed onto `path` in one step, otherwise removed. A reader therefore sees the old
    file or the new one, and a write stopped or failed half-way leaves nothing that looks complete (the
    old file, if any, stays as it was). `path`'s folder is created when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.writing-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
