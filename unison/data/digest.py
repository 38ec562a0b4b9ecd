"""Content hashes of files that may be large (model weights, a faiss index), cheap to ask again while they are
unchanged.

A file's sha256 is remembered in data/.cache/digests.json against its size, mtime, ctime and inode (DVC keeps its hashes
the same way): an unchanged multi-GB file is read once, and any write to it (ctime moves even when mtime is set back)
makes it read again. A file changed in the last RACY_S seconds is not remembered: a second write within the same clock
tick could leave all four unchanged (git's "racily clean" files).
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from pathlib import Path

from .. import layout
from .schemas import write_json

MEMO = Path(layout.DIGESTS)
RACY_S = 2


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def file_digests(files: Iterable[Path], memo_path: Path = MEMO) -> list[str]:
    """Each file's sha256, from the memo where its stat is unchanged; the memo is updated (entries of deleted files
    dropped)."""
    try:
        memo = json.loads(memo_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        memo = {}
    out = []
    for path in files:
        st = path.stat()
        stamp, key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino], str(path.resolve())
        remembered = memo.pop(key, None)
        out.append(remembered[-1] if remembered and remembered[:-1] == stamp else sha256_file(path))
        if time.time_ns() - st.st_mtime_ns > RACY_S * 10**9:
            memo[key] = [*stamp, out[-1]]
    write_json({k: v for k, v in memo.items() if Path(k).exists()}, memo_path)
    return out
