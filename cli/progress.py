"""The progress bars of the long commands."""

from __future__ import annotations

import click


class LazyBar:
    """A click progress bar shown from the first progress report on, so that a mistake
    found before any work (an existing target, a bad option) prints only its error."""

    def __init__(self, length: int, label: str, hidden: bool):
        self.kwargs = {"length": max(1, length), "label": label, "file": click.get_text_stream("stderr")}
        self.hidden = hidden
        self.bar = None

    def update(self, n: int) -> None:
        if self.hidden:
            return
        if self.bar is None:
            self.bar = click.progressbar(**self.kwargs)
            self.bar.__enter__()
        if self.bar.length is not None and self.bar.pos + n > self.bar.length:
            self.bar.length = self.bar.pos + n
        self.bar.update(n)

    def __enter__(self) -> LazyBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
