"""Remote options as a message may show them: without secrets.

A :class:`~.remote.RemoteStore`'s errors name the ``remote_options`` it was given (which endpoint,
which region), and those options carry credentials: s3fs takes them at the top (``key``,
``secret``) and inside ``client_kwargs``; others in ``storage_options``, ``headers`` or the
endpoint URL itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_SECRET = ("key", "secret", "token", "password", "credential", "sas", "auth", "signature")
_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def options_text(options: Mapping[str, Any]) -> str:
    """``options`` as JSON for a message, without secrets: the value of every key that names
    one (``key``, ``secret``, ``token``, ``password``, ...) at any depth of dicts and lists
    (``client_kwargs``, ``config_kwargs``, ``headers``), and the user and password of a URL
    (``http://user:pass@host``), are shown as ``***``."""

    def shown(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {
                str(k): "***" if any(s in str(k).lower() for s in _SECRET) else shown(v)
                for k, v in value.items()
            }
        if isinstance(value, (list, tuple)):
            return [shown(v) for v in value]
        if isinstance(value, str):
            return _USERINFO.sub("***@", value)
        return value

    return json.dumps(shown(options), default=str, sort_keys=True)
