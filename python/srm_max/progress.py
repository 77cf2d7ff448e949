"""The one progress display of the package: a tqdm bar on stderr, plain lines in log files.

    with Progress(total=1000, desc="train", unit="step") as bar:
        for step in ...:
            bar.update(1)                       # or bar.update_to(step), absolute
            bar.set_postfix(loss=f"{loss:.4f}")
            bar.message("step 250: val loss 3.21")  # a line above the bar

- On a terminal it is a ``tqdm`` bar, redrawn at most every ``mininterval`` seconds.
- Anywhere else (a log file, a pipe, CI) it writes plain lines, no carriage
  returns: one per ``log_interval`` seconds at most (every update with 0), and
  the final state on ``close``.
- ``enabled=False`` makes every method a no-op, ``message`` included: a quiet
  run prints nothing.
- ``delay`` hides the display until that many seconds have passed, so short
  work shows nothing at all.

The output goes to ``stream`` (stderr by default): stdout stays for results.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

from tqdm import tqdm

_LINE_KNOWN_TOTAL = "{desc}{percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
_LINE_OPEN_TOTAL = "{desc}{n_fmt} [{elapsed}, {rate_fmt}{postfix}]"


def _format_value(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Progress:
    """Progress of ``total`` units of work (``None``: unknown), starting at ``initial``.

    ``unit_scale=True`` shows large counts with k/M/G prefixes (bytes, tokens).
    """

    def __init__(self, total: int | float | None = None, *, desc: str = "", initial: int | float = 0,
                 unit: str = "it", unit_scale: bool = False, enabled: bool = True, stream: TextIO | None = None,
                 mininterval: float = 0.1, log_interval: float = 10.0, delay: float = 0.0):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.initial, self.n = total, initial, initial
        self.desc, self.unit, self.unit_scale = desc, unit, unit_scale
        self.log_interval, self.delay = log_interval, delay
        self.postfix = ""
        self._t0 = time.perf_counter()
        self._last_line = None  # when the last plain line was written (None: never)
        self._changed = False
        self._closed = False
        self._bar = None
        if enabled and _is_terminal(self.stream):
            self._bar = tqdm(total=total, desc=desc or None, initial=initial, unit=unit, unit_scale=unit_scale,
                             file=self.stream, mininterval=mininterval, delay=delay, dynamic_ncols=True,
                             leave=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int | float = 1) -> None:
        """``n`` more units done."""
        self.update_to(self.n + n)

    def update_to(self, done: int | float, total: int | float | None = None) -> None:
        """``done`` units done in all (and the total, where it changed)."""
        if not self.enabled:
            return
        if total is not None and total != self.total:
            self.total = total
            if self._bar is not None:
                self._bar.total = total
        delta, self.n = done - self.n, done
        self._changed = True
        if self._bar is not None:
            self._bar.update(delta)
        else:
            self._maybe_line()

    def set_postfix(self, **values) -> None:
        """``key=value`` pairs shown after the counts (floats to 4 significant digits;
        pass a formatted string for any other form)."""
        if not self.enabled:
            return
        self.postfix = ", ".join(f"{k}={_format_value(v)}" for k, v in values.items())
        if self._bar is not None:
            self._bar.set_postfix_str(self.postfix, refresh=False)

    def message(self, text: str) -> None:
        """A line of its own (on a terminal: above the bar, which stays)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End the display: the bar stays on screen; a log gets the final state."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self._changed and time.perf_counter() - self._t0 >= self.delay:
            self._write_line()

    def _maybe_line(self) -> None:
        now = time.perf_counter()
        if now - self._t0 < self.delay:
            return
        if self._last_line is None or now - self._last_line >= self.log_interval:
            self._write_line()

    def _write_line(self) -> None:
        self._last_line = time.perf_counter()
        self._changed = False
        line = tqdm.format_meter(
            self.n, self.total, self._last_line - self._t0, prefix=f"{self.desc}: " if self.desc else "",
            unit=self.unit, unit_scale=self.unit_scale, initial=self.initial,
            postfix=self.postfix or None,
            bar_format=_LINE_KNOWN_TOTAL if self.total else _LINE_OPEN_TOTAL)
        self.stream.write(line + "\n")
        self.stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    """A terminal a bar can be drawn on: a tty that reports a width (a pty without a
    window size reports 0 columns, and tqdm would draw nothing there)."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):  # no isatty or fileno, a closed stream, no size
        return False


__all__ = ["Progress"]
