"""Remote options as a message may show them: without secrets.

A :class:`~.remote.RemoteStore`'s errors name the ``remote_options`` it was given (which endpoint,
which region), and those options carry credentials: s3fs takes them at the top (``key``,
``secret``) and inside ``client_kwargs``; others in ``storage_options``, ``headers`` or the
endpoint URL itself.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from typing import Any

_SECRET = (
    "key", "secret", "token", "passw", "pwd", "credential", "sas", "auth", "signature", "sig",
    "cookie", "connection", "private",
)  # fmt: skip
# a URL's user and password: up to the authority's last "@" (a password may hold one)
_USERINFO = re.compile(r"(?<=://)[^/?#\s]*@")
# what may close a quoted or bracketed URL or value in free text (``'s3://b/k?sig=...'``,
# ``(...&token=...)``, ``sig=...,``): kept after the ``***`` where it ends the value, i.e. where
# only such characters stand between the value and the next delimiter (or the end); inside the
# value (``a)b``) it is hidden with the rest. (Possessive runs: linear in the text's length.)
_CLOSE = r"""[)\]}>'"`.,:!]"""


def _value(stop: str) -> str:
    """A value up to a character of ``stop`` (or the end), without the closing characters
    (:data:`_CLOSE`) that end it."""
    plain = f"[^{stop}{_CLOSE[1:-1]}]"
    return f"(?:{plain}|{_CLOSE}++(?={plain}))*+"


# a query parameter or a connection-string field whose name says it is a secret (a SAS
# signature, X-Amz-Signature / -Credential / -Security-Token, AccountKey=...;), in a URL or in
# free text (after an opening quote or bracket, "=" or ":" too); a quote opening the value is
# kept. The name is one run of name characters, then "=": the lookahead (possessive) rejects a
# run without one at once; the name's search for a secret, backwards from the "=", then
# succeeds or fails within the run (a word of 100 kB full of secret names and no "=" was
# searched once per split: quadratic, 2.7 s for "key" * 7000)
_PARAM = re.compile(
    r"""(?i)(?:(?<=[?&;\s'"`(\[{<,=:])|^)(?=[\w.-]*+=)([\w.-]*(?:"""
    + "|".join(_SECRET)
    + r""")[\w.-]*=)(['"`]?)"""
    + _value(r"&;#\s")
)
# a credential in free text (an error that quotes a request's Authorization header)
_SCHEME = re.compile(r"(?i)\b(Bearer|Basic)\s+(?=[^\s,;])" + _value(r"\s,;"))


def url_text(url: str) -> str:
    """``url`` for a message: its user and password, and the values of query parameters that
    name a secret (``sig``, ``X-Amz-Signature``, ``token``, ``AccountKey``, ...) and of
    ``Bearer``/``Basic`` credentials, shown as ``***``. For error texts too: the quotes,
    brackets and punctuation around a secret stay (``'s3://b/k?token=***'``), and a text shown
    so is shown the same again (``url_text(url_text(x)) == url_text(x)``)."""
    # (a credential first: ``auth=Bearer SECRET`` hides both words)
    text = _SCHEME.sub(r"\1 ***", url)
    return _PARAM.sub(r"\1\2***", _USERINFO.sub("***@", text))


def options_text(options: Mapping[str, Any]) -> str:
    """``options`` as JSON for a message, without secrets: the value of every key that names
    one (``key``, ``secret``, ``token``, ``password``, ...) at any depth of dicts and lists
    (``client_kwargs``, ``config_kwargs``, ``headers``), and in strings the user and password of a
    URL (``http://user:pass@host``) and secret query parameters (:func:`url_text`), are shown as
    ``***``."""

    def shown(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {
                str(k): "***" if any(s in str(k).lower() for s in _SECRET) else shown(v)
                for k, v in value.items()
            }
        if isinstance(value, (list, tuple)):
            return [shown(v) for v in value]
        if isinstance(value, str):
            return url_text(value)
        return value

    return json.dumps(shown(options), default=str, sort_keys=True)


def push_command(dirpath: str, url: str, options: Mapping[str, Any]) -> str:
    """The ``resilient-ckpt push`` of ``dirpath`` to ``url`` for a message, in backquotes and
    shell-quoted: with each key of ``options`` as ``-o KEY=...`` (without them, an
    ``endpoint_url`` say, the command went to another store or none), the values left out
    (they may be secrets) for the user to fill in."""
    opts = [w for k in options for w in ("-o", f"{k}=...")]
    said = " (each `...` the value of that key of your remote_options, as JSON)" if opts else ""
    return command("push", dirpath, url, *opts) + said


def command(*words: object) -> str:
    """``resilient-ckpt WORDS`` for a message, in backquotes, each word shell-quoted: pasted
    into a shell, a path with a space or a quote stays one argument (placeholders such as
    ``DIR`` and options such as ``--all`` read as they are)."""
    return "`resilient-ckpt " + " ".join(shlex.quote(str(w)) for w in words) + "`"
