"""Terminal rendering for the CLI: colors, aligned tables, sparklines, progress, live blocks.

Rules the whole CLI follows:

- data goes to stdout, progress and diagnostics to stderr;
- colors only when the stream is a TTY, ``NO_COLOR`` is unset or empty, ``TERM`` is not
  ``dumb``, and ``--no-color`` was not given;
- tables are plain ASCII. On a terminal (or with ``COLUMNS`` set) they fit its width: a
  too-wide flexible column is cut with ``...``, and the columns that explain something (a
  REASON) are never cut but wrap onto continuation lines. Piped (stdout not a terminal and no
  ``COLUMNS``) nothing is cut: a script or ``grep`` sees every cell whole;
- on a TTY progress updates in place (carriage return / cursor-up and clear-line); otherwise
  it is written as plain, throttled lines without escape sequences, so logs stay readable.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import textwrap
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TextIO

ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
ELLIPSIS = "..."

_CODES = {
    "bold": "1",
    "dim": "2",
    "red": "31",
    "green": "32",
    "yellow": "33",
    "blue": "34",
    "magenta": "35",
    "cyan": "36",
}

_forced_no_color = False


def disable_color() -> None:
    """Turns colors off for the whole process (the ``--no-color`` flag)."""
    global _forced_no_color
    _forced_no_color = True


def is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def color_enabled(stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    if _forced_no_color or env.get("NO_COLOR", "") != "" or env.get("TERM") == "dumb":
        return False
    return is_tty(stream)


class Style:
    """Wraps text in ANSI colors when enabled; a no-op otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    @classmethod
    def for_stream(cls, stream: TextIO) -> Style:
        return cls(color_enabled(stream))

    def paint(self, text: str, *names: str) -> str:
        if not self.enabled or not names or not text:
            return text
        codes = ";".join(_CODES[n] for n in names)
        return f"\x1b[{codes}m{text}\x1b[0m"

    def state(self, text: str) -> str:
        """Colors a node or job state name by what it means."""
        key = text.strip().lower()
        if key in ("succeeded", "online"):
            return self.paint(text, "green")
        if key in ("running", "busy"):
            return self.paint(text, "cyan")
        if key in ("failed", "offline", "quarantined", "revoked"):
            return self.paint(text, "red")
        if key in ("cancelled", "paused", "draining", "cordoned", "queued"):
            return self.paint(text, "yellow")
        return text


def strip_ansi(text: str) -> str:
    return ANSI_RE.sub("", text)


def visible_len(text: str) -> int:
    return len(strip_ansi(text))


def truncate(text: str, width: int) -> str:
    """Cuts plain text to ``width`` characters, marking the cut with ``...``."""
    if width <= 0:
        return ""
    if len(text) <= width:
        return text
    if width <= len(ELLIPSIS):
        return text[:width]
    return text[: width - len(ELLIPSIS)] + ELLIPSIS


def truncate_visible(text: str, width: int) -> str:
    """Cuts text that may hold ANSI codes to ``width`` visible characters (codes kept)."""
    if visible_len(text) <= width:
        return text
    out: list[str] = []
    seen = 0
    pos = 0
    while pos < len(text) and seen < width:
        match = ANSI_RE.match(text, pos)
        if match:
            out.append(match.group())
            pos = match.end()
            continue
        out.append(text[pos])
        seen += 1
        pos += 1
    if "\x1b[" in text:
        out.append("\x1b[0m")
    return "".join(out)


def terminal_width(stream: TextIO | None = None, default: int = 80) -> int:
    """The width of the terminal behind ``stream``; ``COLUMNS`` or ``default`` otherwise."""
    stream = sys.stdout if stream is None else stream
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(stream.fileno()).columns or default
    except (AttributeError, OSError, ValueError):
        return shutil.get_terminal_size((default, 24)).columns


def table_width(stream: TextIO | None = None) -> int | None:
    """The width a table on ``stream`` must fit: ``COLUMNS`` when set, the terminal's on a
    terminal, else None (a pipe or a file: no limit, nothing is cut)."""
    stream = sys.stdout if stream is None else stream
    columns = os.environ.get("COLUMNS", "")
    if (columns.isdigit() and int(columns) > 0) or is_tty(stream):
        return terminal_width(stream)
    return None


# The narrowest a wrapped column gets before the table is let overflow instead.
MIN_WRAP = 16


def wrap_cell(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken at spaces where it can be."""
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width=width, break_on_hyphens=False) or [""]


def render_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right: Sequence[int] = (),
    flex: int | None = None,
    width: int | None = 80,
    wrap: Collection[int] = (),
    paint: Mapping[int, Callable[[str], str]] | None = None,
    gap: int = 2,
) -> list[str]:
    """Aligned plain-text table lines (header first).

    ``right`` lists right-aligned column indexes; ``paint`` colors cells of a column after
    padding, so colors never disturb the alignment. When the table is wider than ``width``,
    ``flex`` is the column cut with ``...`` first; then the ``wrap`` columns (those that
    explain: never cut) wrap onto continuation lines, down to `MIN_WRAP` characters. ``width``
    None: no limit, every cell whole (stdout is a pipe).
    """
    ncols = len(headers)
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row[:ncols]):
            widths[i] = max(widths[i], len(cell))
    if width is not None:
        total = sum(widths) + gap * (ncols - 1)
        if flex is not None and flex not in wrap and total > width:
            floor = max(len(headers[flex]), len(ELLIPSIS) + 3)
            widths[flex] = max(floor, widths[flex] - (total - width))
        for i in sorted(wrap, reverse=True):
            total = sum(widths) + gap * (ncols - 1)
            if total <= width or not 0 <= i < ncols:
                continue
            floor = max(len(headers[i]), min(MIN_WRAP, widths[i]))
            widths[i] = max(floor, widths[i] - (total - width))
    lines: list[str] = []
    sep = " " * gap
    for index, row in enumerate([list(headers), *cells]):
        texts = [row[i] if i < len(row) else "" for i in range(ncols)]
        wrapped = {i: wrap_cell(texts[i], widths[i]) for i in wrap if 0 <= i < ncols}
        height = max((len(w) for w in wrapped.values()), default=1)
        for line_no in range(height):
            parts: list[str] = []
            for i in range(ncols):
                if i in wrapped:
                    got = wrapped[i]
                    text = got[line_no] if line_no < len(got) else ""
                elif line_no == 0:
                    text = truncate(texts[i], widths[i])
                else:
                    text = ""
                padded = text.rjust(widths[i]) if i in right else text.ljust(widths[i])
                if index > 0 and paint and i in paint and text:
                    padded = padded.replace(text, paint[i](text), 1)
                parts.append(padded)
            lines.append(sep.join(parts).rstrip())
    return lines


_SPARK_UNICODE = "▁▂▃▄▅▆▇█"
_SPARK_ASCII = "_.-~=+*#"


def _supports_unicode(stream: TextIO | None) -> bool:
    encoding = getattr(stream if stream is not None else sys.stdout, "encoding", None) or ""
    return encoding.lower().replace("-", "") in ("utf8", "utf16", "utf32")


def sparkline(values: Sequence[float], width: int = 40, *, ascii_only: bool = False) -> str:
    """A one-line chart of ``values``: the last values, averaged into ``width`` buckets.

    Non-finite values are skipped. Low values are low ticks, so a falling loss reads as a
    descending staircase.
    """
    finite = [v for v in values if math.isfinite(v)]
    if not finite or width <= 0:
        return ""
    if len(finite) > width:
        # Average consecutive values into exactly `width` buckets (whole history kept).
        buckets: list[float] = []
        for b in range(width):
            lo = b * len(finite) // width
            hi = max(lo + 1, (b + 1) * len(finite) // width)
            chunk = finite[lo:hi]
            buckets.append(sum(chunk) / len(chunk))
        finite = buckets
    ticks = _SPARK_ASCII if ascii_only else _SPARK_UNICODE
    low, high = min(finite), max(finite)
    span = high - low
    if span <= 0:
        return ticks[len(ticks) // 2] * len(finite)
    top = len(ticks) - 1
    return "".join(ticks[round((v - low) / span * top)] for v in finite)


def sparkline_for(stream: TextIO, values: Sequence[float], width: int = 40) -> str:
    return sparkline(values, width, ascii_only=not _supports_unicode(stream))


def progress_bar(fraction: float, width: int = 24) -> str:
    fraction = min(1.0, max(0.0, fraction if math.isfinite(fraction) else 0.0))
    filled = int(round(fraction * width))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def fmt_bytes(n: float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_rate(x: float) -> str:
    """Samples per second, compact: 950, 12.3k, 4.5M."""
    if not math.isfinite(x) or x <= 0:
        return "-"
    if x < 1000:
        return f"{x:.1f}" if x < 100 else f"{x:.0f}"
    if x < 1_000_000:
        return f"{x / 1000:.1f}k"
    return f"{x / 1_000_000:.1f}M"


def fmt_loss(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4f}" if abs(x) < 1000 else f"{x:.4g}"


def fmt_age(ms: int, now_ms: int) -> str:
    if ms <= 0:
        return "-"
    return fmt_duration(max(0, now_ms - ms) / 1000) + " ago"


def fmt_time(ms: int) -> str:
    """Local wall-clock time of a millisecond timestamp, e.g. 2025-01-31 14:05:09."""
    if ms <= 0:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))


class ProgressLine:
    """One line of progress on ``stream``: in place on a TTY, throttled plain lines otherwise.

    On a TTY every ``update`` redraws the line (at most ``tty_interval`` apart); otherwise a
    line is written when the fraction crossed a ``plain_step`` boundary, so a log shows e.g.
    ten lines for one upload. ``done`` always writes the final state on its own line.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        tty: bool | None = None,
        tty_interval: float = 0.1,
        plain_step: float = 0.1,
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.tty = is_tty(self.stream) if tty is None else tty
        self.tty_interval = tty_interval
        self.plain_step = plain_step
        self._last_draw = 0.0
        self._last_step = -1
        self._drawn = False

    def update(self, text: str, fraction: float | None = None) -> None:
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw < self.tty_interval:
                return
            self._last_draw = now
            width = terminal_width(self.stream) - 1
            self.stream.write("\r\x1b[2K" + truncate_visible(text, width))
            self.stream.flush()
            self._drawn = True
            return
        step = -1 if fraction is None else int(fraction / self.plain_step + 1e-9)
        if fraction is not None and step == self._last_step:
            return
        self._last_step = step
        self.stream.write(strip_ansi(text) + "\n")
        self.stream.flush()

    def done(self, text: str) -> None:
        if self.tty:
            width = terminal_width(self.stream) - 1
            self.stream.write("\r\x1b[2K" + truncate_visible(text, width) + "\n")
        else:
            self.stream.write(strip_ansi(text) + "\n")
        self.stream.flush()
        self._drawn = False

    def clear(self) -> None:
        """Removes a half-drawn TTY line (before an error message, say)."""
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self._drawn = False


class LiveBlock:
    """A block of lines redrawn in place on a TTY (cursor up, clear line, rewrite).

    Lines are cut to the terminal width so that none wraps (a wrapped line would break the
    cursor arithmetic). ``finish`` leaves the last drawing on screen and the cursor below it.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self._height = 0

    def update(self, lines: Sequence[str]) -> None:
        width = max(10, terminal_width(self.stream) - 1)
        out: list[str] = []
        if self._height:
            out.append(f"\x1b[{self._height}A\r")
        for line in lines:
            out.append("\x1b[2K" + truncate_visible(line, width) + "\n")
        out.append("\x1b[J")
        self.stream.write("".join(out))
        self.stream.flush()
        self._height = len(lines)

    def finish(self) -> None:
        self._height = 0
        self.stream.flush()


# -- allocation: where a node's time goes ------------------------------------------------------


def fmt_bandwidth(bytes_per_second: float) -> str:
    """A measured link bandwidth in bits per second, as links are quoted: ``95.2 Mbit/s``."""
    if not math.isfinite(bytes_per_second) or bytes_per_second <= 0:
        return "-"
    bits = bytes_per_second * 8
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.1f} {unit}"
    return f"{bits:.0f} bit/s"


def fmt_rtt(ms: float) -> str:
    """A round-trip time: ``50.3 ms``, ``0.21 ms``; ``-`` when unknown (0)."""
    if not math.isfinite(ms) or ms <= 0:
        return "-"
    return f"{ms:.2f} ms" if ms < 1 else f"{ms:.1f} ms"


def fmt_seconds(seconds: float) -> str:
    """A cumulative time: ``0.42s``, ``12.3s``, ``4m05s`` (``fmt_duration`` from a minute)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "-"
    if seconds < 10:
        return f"{seconds:.2f}s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    return fmt_duration(seconds)


def time_split_bar(compute: float, communicate: float, width: int = 20) -> str:
    """``[################....]``: the compute share of compute + communicate time as ``#``,
    communication as ``.``; a bar of spaces when no time was recorded yet."""
    total = compute + communicate
    if not (math.isfinite(total) and total > 0) or width <= 0:
        return "[" + " " * max(0, width) + "]"
    filled = int(round(min(1.0, max(0.0, compute / total)) * width))
    return "[" + "#" * filled + "." * (width - filled) + "]"
