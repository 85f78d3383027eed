"""Progress where a user waits (the warm-up, building a model, an evaluation, a checkpoint write): a bar on
a terminal, plain lines anywhere else.

    with Progress("warm-up", total=600, every=25, line=lambda done, total, note: f"...") as bar:
        for step in ...:
            bar.advance(note=f"loss {loss:.3f}")

On a TTY (the stream's isatty) it is a tqdm bar. On anything else (a log file, CI, a pipe) it writes no
carriage return and no escape code: one line every `every` units and one at the end, formatted by
`line` (default "<what> <done>/<total> <note> (<elapsed>s)"), so logs stay greppable; or nothing at all
with quiet=True (for waits whose result is printed anyway).

`quiet_library_bars(env)` turns off the bars of Hugging Face's libraries in a child whose output goes to
a log file (they draw with carriage returns even there).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

LIBRARY_BARS_OFF = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


def quiet_library_bars(env: dict[str, str]) -> dict[str, str]:
    return {**env, **LIBRARY_BARS_OFF}


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a file
        return False


class Progress:
    def __init__(
        self,
        what: str,
        total: int | None,
        *,
        every: int = 1,
        line: Callable[[int, int | None, str], str] | None = None,
        stream: TextIO | None = None,
        unit: str = "it",
        quiet: bool = False,
        enabled: bool = True,
    ) -> None:
        self.what, self.total, self.every = what, total, max(1, every)
        self.stream = stream if stream is not None else sys.stderr
        self.line = line or self._default_line
        self.done = 0
        self.note = ""
        self.quiet = quiet or not enabled
        self.started = time.monotonic()
        self._bar = None
        if enabled and is_terminal(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=what, file=self.stream, unit=unit, dynamic_ncols=True, leave=True
            )

    def _default_line(self, done: int, total: int | None, note: str) -> str:
        of = f"/{total}" if total is not None else ""
        tail = f" {note}" if note else ""
        return f"{self.what} {done}{of}{tail} ({time.monotonic() - self.started:.0f}s)"

    def advance(self, n: int = 1, note: str = "") -> None:
        before, self.done = self.done, self.done + n
        self.note = note or self.note
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)
        elif self.done // self.every > before // self.every and self.done != self.total:
            self._print()

    def _print(self) -> None:
        if self.quiet:
            return
        self.stream.write(self.line(self.done, self.total, self.note) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.done:
            self._print()  # the last line, whatever `every` is

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
