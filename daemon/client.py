"""A small synchronous HTTP client for the CLI: over the Unix socket, or a TCP URL (http://HOST:PORT)."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 5.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def connection(target: str, timeout: float) -> http.client.HTTPConnection:
    """`target` is a socket path or an http:// URL."""
    if target.startswith("http://"):
        parts = urllib.parse.urlsplit(target)
        return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    return UnixHTTPConnection(target, timeout)


def request_json(
    target: str, method: str, url: str, body: dict | None = None, timeout: float = 5.0, api_key: str | None = None
) -> tuple[int, dict]:
    """(status, parsed JSON body); raises OSError when nothing answers on the socket or URL."""
    conn = connection(target, timeout)
    try:
        payload = None if body is None else json.dumps(body)
        headers = {"Content-Type": "application/json"} if payload else {}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        conn.request(method, url, body=payload, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw) if raw else {}
        except ValueError:
            return resp.status, {"raw": raw.decode(errors="replace")}
    finally:
        conn.close()
