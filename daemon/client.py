"""A small synchronous HTTP client over the Unix socket, for the CLI."""

from __future__ import annotations

import http.client
import json
import socket


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 5.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def request_json(path: str, method: str, url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    """(status, parsed JSON body); raises OSError when nothing answers on the socket."""
    conn = UnixHTTPConnection(path, timeout)
    try:
        payload = None if body is None else json.dumps(body)
        conn.request(method, url, body=payload, headers={"Content-Type": "application/json"} if payload else {})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw) if raw else {}
        except ValueError:
            return resp.status, {"raw": raw.decode(errors="replace")}
    finally:
        conn.close()
