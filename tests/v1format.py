"""Format-1 buffers for the migration tests, made from a format-2 one.

Format 1 differs from format 2 in the metadata alone (the data files are the same): its
``mmreplay.json`` holds the committed state and there is no state file. The stores in
``datasets/`` were written in format 1 by the code of that format and are kept as they
are; this script makes small ones of any layout the same way that code wrote them.
"""

from __future__ import annotations

import json
import os
import zlib

from mmreplay.metadata import METADATA_FILE, STATE_FILE, read_metadata, render


def to_v1(path: str) -> None:
    """Rewrite the closed buffer at ``path`` in format 1, byte for byte as format 1 did."""
    meta = read_metadata(path)
    s = meta.state
    body = json.loads(render(meta))  # format 2's keys, in the same order as format 1's
    for key in ("checksum", "attrs_generation", "previous_attrs"):
        body.pop(key, None)
    body["format"] = "mmreplay/1"
    state = {"start": s.start, "end": s.end, "reserved": s.reserved, "commits": s.commits, "commit_time": s.commit_time}
    text = f'{json.dumps(body, indent=1)[:-2]},\n "state": {json.dumps(state)}'.encode()
    raw = text + b',\n "checksum": "crc32:%08x"\n}\n' % zlib.crc32(text)
    with open(os.path.join(path, METADATA_FILE), "wb") as f:
        f.write(raw)
    os.remove(os.path.join(path, STATE_FILE))
