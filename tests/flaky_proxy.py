"""A tiny HTTP proxy in front of an S3 API server (moto's, on 127.0.0.1) that fails requests on
demand: a store answering errors for a while (503 SlowDown, 500), or one that did the work and
lost the answer (forwarded, then 500).

``rule(method, path, query) -> str | None`` decides per request: ``None`` forwards it;
``"slowdown"`` answers 503 SlowDown without forwarding; ``"error"`` answers 500 without
forwarding; ``"lost"`` forwards it and then answers 500 (the store did it; the client cannot
know); ``"drop"`` forwards it and closes the connection unanswered; ``"denied"`` answers 403 InvalidAccessKeyId (credentials that became invalid); ``"forbidden"``
answers 403 AccessDenied (a policy that denies the request).

``refuse_key(key) -> bool`` (settable at any time) makes the store refuse to delete some keys
of a batched delete (``POST ?delete``, S3's DeleteObjects), as a policy denying those deletes
does: the others are forwarded and deleted, and the answer names each refused key with
``AccessDenied`` (``refused`` lists them).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit
from xml.sax.saxutils import escape, unescape

Rule = Callable[[str, str, str], "str | None"]

_ERRORS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "error": (500, "InternalError", "We encountered an internal error. Please try again."),
    "lost": (500, "InternalError", "We encountered an internal error. Please try again."),
    "denied": (403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist."),
    "forbidden": (403, "AccessDenied", "Access Denied"),
}


class FlakyProxy:
    def __init__(self, upstream: str, rule: Rule | None = None) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.rule: Rule = rule or (lambda m, p, q: None)
        self.seen: list[tuple[str, str, str | None]] = []  # (method, path, what was done)
        self.refuse_key: Callable[[str], bool] | None = None
        self.refused: list[str] = []  # keys a batched delete was refused (refuse_key)
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                length = str(len(body))
                for k, v in headers:
                    if k.lower() == "content-length" and self.command == "HEAD":
                        length = v  # (a HEAD's: the object's size, with no body)
                    elif k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _error(self, what: str) -> None:
                status, code, msg = _ERRORS[what]
                body = (
                    f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                    f"<Message>{msg}</Message></Error>"
                ).encode()
                self._answer(status, [("Content-Type", "application/xml")], body)

            def _handle(self) -> None:
                body = self._body()
                path, _, query = self.path.partition("?")
                with proxy.lock:
                    what = proxy.rule(self.command, path, query)
                    proxy.seen.append((self.command, path, what))
                if what in ("slowdown", "error", "denied", "forbidden"):
                    self._error(what)
                    return
                refuse, refused = proxy.refuse_key, []
                if refuse is not None and self.command == "POST" and "delete" in query:
                    body, refused = _without_refused(body, refuse)
                    with proxy.lock:
                        proxy.refused.extend(refused)
                    if b"<Object>" not in body:  # every key refused: nothing to forward
                        self._answer(200, [("Content-Type", "application/xml")], _result(refused))
                        return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                    headers.pop("Transfer-Encoding", None)
                    headers["Content-Length"] = str(len(body))
                    if refused:  # the body changed: its checksums with it
                        headers = {
                            k: v
                            for k, v in headers.items()
                            if not k.lower().startswith(("x-amz-checksum", "x-amz-sdk-checksum"))
                            and k.lower() != "content-md5"
                        }
                        headers["Content-MD5"] = base64.b64encode(
                            hashlib.md5(body).digest()
                        ).decode()
                    headers["Host"] = f"{proxy.upstream[0]}:{proxy.upstream[1]}"
                    conn.request(self.command, self.path, body=body, headers=headers)
                    r = conn.getresponse()
                    data = r.read()
                    if what == "lost":
                        self._error("lost")
                        return
                    if what == "drop":  # the store did it; the connection dies unanswered
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    if refused and r.status == 200:
                        data = re.sub(
                            rb"<DeleteResult([^>]*)/>", rb"<DeleteResult\1></DeleteResult>", data
                        ).replace(b"</DeleteResult>", _errors(refused) + b"</DeleteResult>")
                    self._answer(r.status, r.getheaders(), data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        # (close's shutdown waits for serve_forever to look at its flag: every poll_interval,
        # 0.5 s by default, an average of 0.25 s a proxy)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


_OBJECT = re.compile(rb"<Object>\s*<Key>(.*?)</Key>.*?</Object>", re.DOTALL)


def _without_refused(body: bytes, refuse: Callable[[str], bool]) -> tuple[bytes, list[str]]:
    """A DeleteObjects request body without the objects whose key ``refuse`` refuses."""
    refused: list[str] = []

    def keep(m: re.Match) -> bytes:
        key = unescape(m.group(1).decode())
        if refuse(key):
            refused.append(key)
            return b""
        return m.group(0)

    return _OBJECT.sub(keep, body), refused


def _errors(refused: list[str]) -> bytes:
    return "".join(
        f"<Error><Key>{escape(k)}</Key><Code>AccessDenied</Code><Message>Access Denied"
        "</Message></Error>"
        for k in refused
    ).encode()


def _result(refused: list[str]) -> bytes:
    return (
        b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult '
        b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/">' + _errors(refused) + b"</DeleteResult>"
    )
