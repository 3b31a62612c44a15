"""A small hand-written SVG canvas for the pictures in ``docs/pictures/``.

No dependency and no font metrics: fixed geometry, generic fonts (``monospace``,
``sans-serif``), a white background so a picture reads on light and dark pages, and nothing
that changes between runs (the pictures are checked byte for byte). Used by
``engine/distributed/pictures.py`` (the process trees), ``engine/kv_cache/pictures.py``,
``engine/distributed/request_path_picture.py`` and ``engine/core/wave_picture.py``.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

MONO = "monospace"
SANS = "sans-serif"
TEXT = "#1f2328"
MUTED = "#57606a"
MARGIN = 24


def num(v: float) -> str:
    """A coordinate as a short, stable string."""
    r = round(v, 1)
    return str(int(r)) if r == int(r) else f"{r:.1f}"


def text_width(text: str, size: float, mono: bool) -> float:
    """A generous estimate of the width of ``text`` (no font metrics: generic fonts)."""
    return len(text) * size * (0.63 if mono else 0.58)


class Canvas:
    """The elements of one picture in three layers: boxes, then lines, then labels."""

    def __init__(self) -> None:
        self.boxes: list[str] = []
        self.lines: list[str] = []
        self.labels: list[str] = []
        self.markers: dict[str, str] = {}  # colour -> marker id
        self.max_x = 0.0
        self.max_y = 0.0

    def _extend(self, x: float, y: float) -> None:
        self.max_x, self.max_y = max(self.max_x, x), max(self.max_y, y)

    def rect(self, x: float, y: float, w: float, h: float, *, fill: str = "#ffffff", stroke: str = TEXT,
             rx: float = 0, width: float = 1.2, dashed: bool = False, at: int | None = None) -> None:  # fmt: skip
        """A rectangle, drawn after the boxes so far, or (``at``: an index of ``boxes``) under
        the ones drawn since: a box sized after its contents."""
        dash = ' stroke-dasharray="5 3"' if dashed else ""
        round_ = f' rx="{num(rx)}"' if rx else ""
        self.boxes.insert(
            len(self.boxes) if at is None else at,
            f'<rect x="{num(x)}" y="{num(y)}" width="{num(w)}" height="{num(h)}"{round_} '
            f'fill="{fill}" stroke="{stroke}" stroke-width="{num(width)}"{dash}/>',
        )
        self._extend(x + w, y + h)

    def path(self, points: list[tuple[float, float]], colour: str, *, width: float = 2, dashed: bool = False,
             end: bool = True, start: bool = False, halo: bool = False) -> None:  # fmt: skip
        """A line through ``points``; ``halo``: on a wide white band, so a line it crosses is
        seen to pass under it, not to join it."""
        d = " ".join(f"{'M' if i == 0 else 'L'}{num(x)} {num(y)}" for i, (x, y) in enumerate(points))
        marker = self.markers.setdefault(colour, f"arrow{len(self.markers)}")
        attrs = f'd="{d}" fill="none" stroke="{colour}" stroke-width="{num(width)}"'
        if dashed:
            attrs += ' stroke-dasharray="6 4"'
        if start:
            attrs += f' marker-start="url(#{marker}-start)"'
        if end:
            attrs += f' marker-end="url(#{marker}-end)"'
        if halo:
            self.lines.append(f'<path d="{d}" fill="none" stroke="#ffffff" stroke-width="8"/>')
        self.lines.append(f"<path {attrs}/>")
        for x, y in points:
            self._extend(x, y)

    def text(self, x: float, y: float, text: str, *, size: float = 12, mono: bool = False, bold: bool = False,
             anchor: str = "start", colour: str = TEXT, chip: bool = False) -> float:  # fmt: skip
        """One line of text with its baseline at ``y``; ``chip``: on a white rectangle, so a
        line under it does not run through the letters. Returns the text's estimated width."""
        width = text_width(text, size, mono)
        left = x - {"start": 0, "middle": width / 2, "end": width}[anchor]
        if chip:
            self.labels.append(
                f'<rect x="{num(left - 3)}" y="{num(y - size)}" width="{num(width + 6)}" '
                f'height="{num(size + 5)}" fill="#ffffff"/>'
            )
        weight = ' font-weight="bold"' if bold else ""
        self.labels.append(
            f'<text x="{num(x)}" y="{num(y)}" font-family="{MONO if mono else SANS}" '
            f'font-size="{num(size)}"{weight} text-anchor="{anchor}" fill="{colour}">{escape(text)}</text>'
        )
        self._extend(left + width + 4, y + 4)
        return width

    def badge(self, x: float, y: float, label: str, colour: str) -> float:
        """A step number (``3a``) on a filled pill whose left edge is ``x``, centred on
        ``y``; returns its width."""
        w = 12 + 7.5 * len(label)
        self.labels.append(
            f'<rect x="{num(x)}" y="{num(y - 9)}" width="{num(w)}" height="18" rx="9" fill="{colour}"/>'
        )
        self.labels.append(
            f'<text x="{num(x + w / 2)}" y="{num(y + 4.5)}" font-family="{SANS}" font-size="12.5" '
            f'font-weight="bold" text-anchor="middle" fill="#ffffff">{escape(label)}</text>'
        )
        self._extend(x + w, y + 9)
        return w

    def render(self, title: str, desc: str, generated_by: str) -> str:
        width, height = self.max_x + MARGIN, self.max_y + MARGIN
        markers = []
        for colour, marker in self.markers.items():
            for which, d in (("end", "M0 0 L10 5 L0 10 z"), ("start", "M10 0 L0 5 L10 10 z")):
                markers.append(
                    f'<marker id="{marker}-{which}" viewBox="0 0 10 10" refX="{10 if which == "end" else 0}" '
                    f'refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="{d}" fill="{colour}"/></marker>'
                )
        return "\n".join([
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{num(width)}" height="{num(height)}" '
            f'viewBox="0 0 {num(width)} {num(height)}" role="img">',
            f"<!-- Generated by {generated_by}; do not edit by hand. -->",
            f"<title>{escape(title)}</title>",
            f"<desc>{escape(desc)}</desc>",
            "<defs>", *markers, "</defs>",
            f'<rect x="0" y="0" width="{num(width)}" height="{num(height)}" fill="#ffffff"/>',
            *self.boxes, *self.lines, *self.labels,
            "</svg>",
        ]) + "\n"  # fmt: skip


def write_svgs(pictures: dict[str, str], out_dir: Path) -> list[Path]:
    """Write each picture (file name -> SVG text) into ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in pictures.items():
        path = out_dir / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
