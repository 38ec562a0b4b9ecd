"""`storage.*`: where DVC data is shared between machines."""
from __future__ import annotations

import os

from pydantic import Field, model_validator

from .base import Section


def check_remote(url: str, key: str) -> str:
    """A DVC remote: "" (none), a URL such as s3://bucket/path, or an absolute path (a directory every machine
    mounts)."""
    scheme, _, rest = url.partition("://")
    if url and not rest and not os.path.isabs(url):
        raise ValueError(f"{key}: {url!r} is neither a URL (s3://bucket/path) nor an absolute path of a "
                         "shared directory")
    if rest and "@" in rest.split("/")[0]:
        raise ValueError(f"{key}: credentials do not go in the URL; set them in the environment (AWS_ACCESS_KEY_ID, "
                         f"AWS_SECRET_ACCESS_KEY), where DVC reads them")
    return url


class StorageConfig(Section):
    remote: str = Field("", description='the DVC remote machines share: s3://bucket/path (endpoint: AWS_ENDPOINT_URL) '
                        'or a shared directory\'s absolute path; "" = none; UNISON_DVC_REMOTE overrides it; '
                        'credentials only in the environment')

    @model_validator(mode="after")
    def _remote(self):
        check_remote(self.remote, "storage.remote")
        return self
