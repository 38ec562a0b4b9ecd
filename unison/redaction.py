"""Secrets out of text: credentials in URLs and secret-looking query values, before anything is logged, recorded or
raised."""
from __future__ import annotations

import re

_USERINFO = re.compile(r"(\w[\w+.-]*://)[^/\s@]*@")
_SECRET_QUERY = re.compile(r"([?&;][^=&;\s]*(?:key|token|secret|password|passwd|pwd|auth|sig|credential)[^=&;\s]*=)"
                           r"[^&;\s'\"#]*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every URL's user:password@ and every secret-looking query value (key, token, secret, password, auth,
    sig, credential in the name) replaced by ***; for anything logged, recorded or raised that may hold a URL."""
    return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub(r"\1***@", text))
