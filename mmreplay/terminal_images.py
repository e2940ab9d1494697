"""Pictures in the terminal: the kitty graphics protocol and iTerm2's inline images.

Which one a terminal speaks is read from its environment variables; a pipe or a file
never gets escape codes.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping

__all__ = ["image_protocol", "terminal_image"]

#: TERM_PROGRAM values of terminals that show iTerm2's inline images
ITERM2_PROGRAMS = ("iTerm.app", "WezTerm")
KITTY_CHUNK = 4096


def image_protocol(environ: Mapping[str, str], isatty: bool) -> str | None:
    """``"kitty"`` or ``"iterm2"`` when the terminal shows inline images, else None.

    Never an image when the output is not a terminal (a pipe or a file must not get
    escape codes), nor inside tmux / screen, which would need their passthrough.
    """
    if not isatty or environ.get("TMUX") or environ.get("TERM", "").startswith("screen"):
        return None
    if (
        environ.get("KITTY_WINDOW_ID")
        or environ.get("TERM") == "xterm-kitty"
        or environ.get("TERM_PROGRAM") == "ghostty"
    ):
        return "kitty"
    if environ.get("TERM_PROGRAM") in ITERM2_PROGRAMS or environ.get("LC_TERMINAL") == "iTerm2":
        return "iterm2"
    return None


def terminal_image(png: bytes, protocol: str) -> str:
    """The escape sequence that shows a PNG inline with the kitty graphics protocol or
    iTerm2's inline images, followed by a newline."""
    data = base64.b64encode(png).decode("ascii")
    if protocol == "iterm2":
        return f"\x1b]1337;File=inline=1;size={len(png)};preserveAspectRatio=1:{data}\x07\n"
    if protocol != "kitty":
        raise ValueError(f"protocol must be 'kitty' or 'iterm2', got {protocol!r}")
    parts = [data[i : i + KITTY_CHUNK] for i in range(0, len(data), KITTY_CHUNK)] or [""]
    out = []
    for i, part in enumerate(parts):
        more = int(i < len(parts) - 1)
        keys = f"f=100,a=T,m={more}" if i == 0 else f"m={more}"
        out.append(f"\x1b_G{keys};{part}\x1b\\")
    return "".join(out) + "\n"
