"""A minimal line-chart PNG writer (numpy + zlib; matplotlib is not a dependency of mobc).

Enough for the bench's plots: axes with ticks, labelled with a 3x5 pixel font scaled up,
polylines and markers per series, and a legend. Text is upper-cased (the font has no lower case).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_FONT = {  # 3x5 glyphs, rows top to bottom
    "0": ["###", "#.#", "#.#", "#.#", "###"], "1": [".#.", "##.", ".#.", ".#.", "###"],
    "2": ["###", "..#", "###", "#..", "###"], "3": ["###", "..#", ".##", "..#", "###"],
    "4": ["#.#", "#.#", "###", "..#", "..#"], "5": ["###", "#..", "###", "..#", "###"],
    "6": ["###", "#..", "###", "#.#", "###"], "7": ["###", "..#", ".#.", ".#.", ".#."],
    "8": ["###", "#.#", "###", "#.#", "###"], "9": ["###", "#.#", "###", "..#", "###"],
    "A": [".#.", "#.#", "###", "#.#", "#.#"], "B": ["##.", "#.#", "##.", "#.#", "##."],
    "C": [".##", "#..", "#..", "#..", ".##"], "D": ["##.", "#.#", "#.#", "#.#", "##."],
    "E": ["###", "#..", "##.", "#..", "###"], "F": ["###", "#..", "##.", "#..", "#.."],
    "G": [".##", "#..", "#.#", "#.#", ".##"], "H": ["#.#", "#.#", "###", "#.#", "#.#"],
    "I": ["###", ".#.", ".#.", ".#.", "###"], "J": ["..#", "..#", "..#", "#.#", ".#."],
    "K": ["#.#", "#.#", "##.", "#.#", "#.#"], "L": ["#..", "#..", "#..", "#..", "###"],
    "M": ["#.#", "###", "###", "#.#", "#.#"], "N": ["##.", "#.#", "#.#", "#.#", "#.#"],
    "O": [".#.", "#.#", "#.#", "#.#", ".#."], "P": ["##.", "#.#", "##.", "#..", "#.."],
    "Q": [".#.", "#.#", "#.#", "##.", ".##"], "R": ["##.", "#.#", "##.", "#.#", "#.#"],
    "S": [".##", "#..", ".#.", "..#", "##."], "T": ["###", ".#.", ".#.", ".#.", ".#."],
    "U": ["#.#", "#.#", "#.#", "#.#", "###"], "V": ["#.#", "#.#", "#.#", "#.#", ".#."],
    "W": ["#.#", "#.#", "###", "###", "#.#"], "X": ["#.#", "#.#", ".#.", "#.#", "#.#"],
    "Y": ["#.#", "#.#", ".#.", ".#.", ".#."], "Z": ["###", "..#", ".#.", "#..", "###"],
    ".": ["...", "...", "...", "...", ".#."], "-": ["...", "...", "###", "...", "..."],
    "/": ["..#", "..#", ".#.", "#..", "#.."], ":": ["...", ".#.", "...", ".#.", "..."],
    "(": [".#.", "#..", "#..", "#..", ".#."], ")": [".#.", "..#", "..#", "..#", ".#."],
    "%": ["#.#", "..#", ".#.", "#..", "#.#"], "=": ["...", "###", "...", "###", "..."],
    "+": ["...", ".#.", "###", ".#.", "..."], ",": ["...", "...", "...", ".#.", "#.."],
    " ": ["...", "...", "...", "...", "..."], "_": ["...", "...", "...", "...", "###"],
}
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189), (140, 86, 75)]


class Canvas:
    def __init__(self, width: int, height: int):
        self.px = np.full((height, width, 3), 255, np.uint8)

    def dot(self, x: int, y: int, color, r: int = 1) -> None:
        h, w, _ = self.px.shape
        self.px[max(0, y - r + 1) : min(h, y + r), max(0, x - r + 1) : min(w, x + r)] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color, r: int = 1) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for t in np.linspace(0.0, 1.0, n + 1):
            self.dot(int(round(x0 + (x1 - x0) * t)), int(round(y0 + (y1 - y0) * t)), color, r)

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> None:
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT[" "])
            for r, row in enumerate(glyph):
                for c, bit in enumerate(row):
                    if bit == "#":
                        self.px[y + r * scale : y + (r + 1) * scale, x + c * scale : x + (c + 1) * scale] = color
            x += 4 * scale

    def save(self, path: str | Path) -> Path:
        h, w, _ = self.px.shape
        raw = b"".join(b"\x00" + self.px[y].tobytes() for y in range(h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
        path = Path(path)
        path.write_bytes(png)
        return path


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    span = hi - lo or 1.0
    step = 10 ** np.floor(np.log10(span / n))
    for m in (1, 2, 5, 10):
        if span / (m * step) <= n:
            step *= m
            break
    start = np.ceil(lo / step) * step
    return [float(v) for v in np.arange(start, hi + step * 1e-9, step)]


def line_chart(path: str | Path, series: dict[str, tuple[Sequence[float], Sequence[float]]], title: str,
               xlabel: str, ylabel: str, marks: Sequence[float] = (), size: tuple[int, int] = (900, 560)) -> Path:
    """series: name -> (xs, ys). `marks`: x positions drawn as dashed verticals (e.g. compiled widths)."""
    w, h = size
    c = Canvas(w, h)
    left, right, top, bottom = 90, w - 30, 60, h - 70
    xs = [x for s in series.values() for x in s[0]] + list(marks)
    ys = [y for s in series.values() for y in s[1]]
    x0, x1 = min(xs), max(xs)
    y0, y1 = 0.0, max(ys) * 1.1 if ys else 1.0

    def px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x0) / ((x1 - x0) or 1) * (right - left), bottom - (y - y0) / ((y1 - y0) or 1) * (bottom - top))

    grey = (200, 200, 200)
    for m in marks:
        xm, _ = px(m, 0)
        for yy in range(top, bottom, 12):
            c.line(xm, yy, xm, min(yy + 6, bottom), grey)
    c.line(left, bottom, right, bottom, (0, 0, 0))
    c.line(left, bottom, left, top, (0, 0, 0))
    for t in _ticks(x0, x1):
        xt, _ = px(t, 0)
        c.line(xt, bottom, xt, bottom + 5, (0, 0, 0))
        label = f"{t:g}"
        c.text(int(xt - len(label) * 4), bottom + 10, label)
    for t in _ticks(y0, y1):
        _, yt = px(0, t)
        c.line(left - 5, yt, left, yt, (0, 0, 0))
        label = f"{t:g}"
        c.text(left - 10 - len(label) * 8, int(yt - 5), label)
    for i, (name, (sx, sy)) in enumerate(series.items()):
        col = COLORS[i % len(COLORS)]
        pts = [px(x, y) for x, y in zip(sx, sy, strict=True)]
        for a, b in zip(pts, pts[1:], strict=False):
            c.line(a[0], a[1], b[0], b[1], col, r=2)
        for p in pts:
            c.dot(int(p[0]), int(p[1]), col, r=3)
        c.line(left + 20, top + 10 + 18 * i, left + 50, top + 10 + 18 * i, col, r=2)
        c.text(left + 60, top + 5 + 18 * i, name, col)
    c.text(left, 12, title, scale=3)
    c.text((left + right) // 2 - len(xlabel) * 4, h - 30, xlabel)
    c.text(10, top - 16, ylabel)
    return c.save(path)
