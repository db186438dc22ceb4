"""Who may use the daemon: API keys, Host and Origin checks, JSON-only bodies, CORS.

The Unix socket's guard is its file mode (0600 in a 0700 directory); a TCP
listener has none, so every TCP request passes, in this order:

1. Host: the `Host` header must name this daemon (the address it listens on,
   the address the connection arrived at, loopback names for a loopback
   listener, or `--allowed-hosts`); anything else is a DNS-rebinding page -> 403.
2. Origin: a request carrying `Origin` comes from a browser page; refused
   (403) unless that origin is in `--allowed-origins`. Allowed origins get
   CORS answers, preflight `OPTIONS` included (answered before the key check:
   browsers never send credentials on a preflight).
3. Key: with keys configured, `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`), compared in
   constant time against every key -> else 401 with `WWW-Authenticate: Bearer`.
4. Content type: a POST or PUT body must be `application/json` -> else 415.
   This alone stops the "simple" cross-site POST a browser sends unasked.

On the Unix socket only control endpoints (switching the mode) need the key,
and every request does with `--socket-requires-key`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from .protocol import ApiError

log = logging.getLogger("minibatch.daemon")

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Endpoints that change what the daemon does for everybody: the key is needed on every listener.
CONTROL = frozenset({("PUT", "/v1/engine/mode")})
JSON_TYPES = ("application/json",)
CORS_MAX_AGE = "600"


class GuardError(ValueError):
    """The security options cannot work together (reported before anything binds)."""


def is_loopback(host: str | None) -> bool:
    if not host or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def match_key(given: str, keys: tuple[str, ...]) -> int | None:
    """The index of the key `given` equals, or None; the time taken does not depend on where they differ.

    Every key is compared (no early exit on the first match), each with
    hmac.compare_digest over bytes.
    """
    found = None
    try:
        g = given.encode()
    except UnicodeEncodeError:  # a header that is not text (undecodable bytes): no key it could be
        return None
    for i, key in enumerate(keys):
        if hmac.compare_digest(g, key.encode()) and found is None:
            found = i
    return found


def keys_match(given: str, keys: tuple[str, ...]) -> bool:
    return match_key(given, keys) is not None


IDENTITY = "minibatch.identity"  # request[IDENTITY]: who sent it (a key's name, or LOCAL)
IDENTITY_HEADER = "X-Minibatch-Identity"  # how a cluster's ingress tells its replicas who sent a request
LOCAL = "local"  # a request that showed no key: the socket's own user (or a loopback listener's, without keys)
_KEY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def key_name(secret: str) -> str:
    """The name of a key given without one: stable, and telling nothing of the key."""
    return "key-" + hashlib.sha256(secret.encode()).hexdigest()[:10]


def parse_key(entry: str, source: str) -> tuple[str, str]:
    """(name, secret) from `name=secret`, or (its derived name, the entry) for a key without a name."""
    name, sep, secret = entry.partition("=")
    if sep and _KEY_NAME.fullmatch(name) and len(secret) >= 8:
        if name == LOCAL:
            raise GuardError(f"{source}: {LOCAL!r} names the socket's own user; give the key another name")
        return name, check_key(secret, source)
    return key_name(check_key(entry, source)), entry


def read_key_file(path: Path) -> tuple[str, ...]:
    """One key per line (`name=secret`, or a secret alone); blank lines and lines starting with # are
    skipped."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise GuardError(f"--api-key-file: cannot read {path}: {exc.strerror}") from None
    keys = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise GuardError(f"--api-key-file: {path} holds no key (one key per line)")
    return keys


def check_key(key: str, source: str) -> str:
    if len(key) < 8 or any(c.isspace() for c in key) or not key.isprintable():
        raise GuardError(f"{source}: a key must be at least 8 printable characters without spaces")
    return key


def _check_names(named: list[tuple[str, str]], source: str) -> None:
    """One name per key: a name given to two different keys could not say whose a stored response is."""
    seen: dict[str, str] = {}
    for name, secret in named:
        if seen.setdefault(name, secret) != secret:
            raise GuardError(f"{source}: the name {name!r} is given to two different keys")


def split_host(value: str) -> str:
    """The host part of a Host header value, lower-cased, IPv6 without brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        return value.rsplit(":", 1)[0]
    return value


def origin_of(value: str) -> str:
    return value.strip().rstrip("/").lower()


@dataclass
class Guard:
    """The security settings of one daemon and the counters of what they refused."""

    api_keys: tuple[str, ...] = ()  # the secrets
    api_key_file: Path | None = None
    socket_requires_key: bool = False
    listen_host: str | None = None  # the TCP --host (None: no TCP listener)
    allowed_hosts: frozenset[str] = frozenset()
    allowed_origins: frozenset[str] = frozenset()
    insecure_no_auth: bool = False
    flag_keys: tuple[str, ...] = ()  # from --api-key / MINIBATCH_API_KEY: kept when the file is reread
    key_names: dict[str, str] = field(default_factory=dict)  # secret -> its name (who a request is)
    refused: dict[str, int] = field(
        default_factory=lambda: {
            "unauthorized": 0,
            "forbidden_host": 0,
            "forbidden_origin": 0,
            "unsupported_media_type": 0,
        }
    )
    _file_stamp: tuple | None = None
    _checked_at: float = 0.0

    @classmethod
    def from_options(
        cls,
        api_key: str | None = None,
        api_key_file: str | Path | None = None,
        socket_requires_key: bool = False,
        host: str | None = None,
        port: int | None = None,
        allowed_hosts: str | None = None,
        allowed_origins: str | None = None,
        insecure_no_auth: bool = False,
    ) -> Guard:
        """Validate the options together; raises GuardError with the flag to change."""
        named: list[tuple[str, str]] = []
        if api_key:  # one key, or several separated by commas
            named += [parse_key(k.strip(), "--api-key") for k in api_key.split(",") if k.strip()]
        flag_count = len(named)
        path = Path(api_key_file).expanduser() if api_key_file else None
        if path is not None:
            named += [parse_key(k, f"--api-key-file {path}") for k in read_key_file(path)]
        _check_names(named, "--api-key / --api-key-file")
        keys = [secret for _, secret in named]
        if socket_requires_key and not keys:
            raise GuardError("--socket-requires-key needs a key (--api-key, MINIBATCH_API_KEY or --api-key-file)")
        tcp_host = (host or "127.0.0.1") if port is not None else None
        if tcp_host is not None and not is_loopback(tcp_host) and not keys and not insecure_no_auth:
            raise GuardError(
                f"--host {tcp_host} would let every machine that can reach it use the daemon, and no API key is set. "
                "Give one with --api-key (or MINIBATCH_API_KEY, or --api-key-file), "
                "or accept the risk with --insecure-no-auth."
            )
        hosts = frozenset(split_host(h) for h in (allowed_hosts or "").split(",") if h.strip())
        origins = frozenset(origin_of(o) for o in (allowed_origins or "").split(",") if o.strip())
        guard = cls(
            tuple(dict.fromkeys(keys)),
            path,
            socket_requires_key,
            tcp_host,
            hosts,
            origins,
            insecure_no_auth,
            key_names={secret: name for name, secret in named},
            flag_keys=tuple(keys[:flag_count]),
        )
        if path is not None:
            guard._file_stamp = guard._stamp()
            guard.warn_if_readable()
        return guard

    # -- keys ---------------------------------------------------------------

    def _stamp(self) -> tuple | None:
        try:
            st = self.api_key_file.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def warn_if_readable(self) -> None:
        try:
            mode = self.api_key_file.stat().st_mode
        except OSError:
            return
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(
                "the API key file %s can be read by other users (mode %o); chmod 600 it",
                self.api_key_file,
                mode & 0o777,
            )

    def reload_keys(self) -> None:
        """Keys are rotated by editing the key file: it is read again when it changes.

        The file's modification time is checked at most once a second.
        """
        if self.api_key_file is None:
            return
        now = time.monotonic()
        if now - self._checked_at < 1.0:
            return
        self._checked_at = now
        stamp = self._stamp()
        if stamp == self._file_stamp:
            return
        self._file_stamp = stamp
        try:
            named = [parse_key(k, "--api-key-file") for k in read_key_file(self.api_key_file)]
            flags = [(self.key_names[k], k) for k in self.flag_keys]
            _check_names(flags + named, "--api-key-file")
        except GuardError as exc:
            log.error("API keys not reloaded, the previous ones stay in force: %s", exc)
            return
        self.key_names = {secret: name for name, secret in flags + named}
        self.api_keys = tuple(dict.fromkeys(self.flag_keys + tuple(secret for _, secret in named)))
        log.info("API keys reloaded from %s: %d key(s)", self.api_key_file, len(self.api_keys))

    def describe(self) -> str:
        """A log line that says how each listener is guarded (never a key)."""
        n = len(self.api_keys)
        keys = f"{n} API key{'s' if n != 1 else ''}" + (
            f" (from {self.api_key_file}, reread when it changes)" if self.api_key_file else ""
        )
        parts = [f"socket: file permissions{' + key' if self.socket_requires_key else ''}"]
        if self.listen_host is not None:
            tcp = keys if n else ("NO KEY (--insecure-no-auth)" if self.insecure_no_auth else "no key (loopback only)")
            origins = ", ".join(sorted(self.allowed_origins)) or "none"
            parts.append(
                f"tcp: {tcp}; Host checked; browser origins allowed: {origins}; bodies must be application/json"
            )
        elif n:
            parts.append(keys + " for control endpoints")
        return "; ".join(parts)

    # -- per request --------------------------------------------------------

    def allowed_host_names(self, request: web.Request) -> set[str]:
        names = set(self.allowed_hosts)
        host = split_host(self.listen_host or "127.0.0.1")
        if host in ("0.0.0.0", "::", ""):
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        else:
            names.add(host)
        if is_loopback(host) or host in ("0.0.0.0", "::"):
            names |= LOOPBACK_NAMES
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        if isinstance(sockname, tuple) and sockname:
            names.add(str(sockname[0]).lower())  # the address the client actually connected to
        return names

    def check(self, request: web.Request, tcp: bool) -> web.StreamResponse | None:
        """None when the request may go on; a response (preflight answer) to send instead; raises ApiError to refuse."""
        origin = request.headers.get("Origin")
        if tcp:
            host = request.headers.get("Host")
            if "*" not in self.allowed_hosts and (
                host is None or split_host(host) not in self.allowed_host_names(request)
            ):
                self.refused["forbidden_host"] += 1
                raise ApiError(
                    403,
                    "Host: this daemon does not answer to that host name (add it with --allowed-hosts)",
                    "Host",
                    "forbidden_host",
                    "permission_error",
                )
            if origin is not None and origin_of(origin) not in self.allowed_origins and "*" not in self.allowed_origins:
                self.refused["forbidden_origin"] += 1
                raise ApiError(
                    403,
                    "Origin: requests from web pages are refused unless their origin is in --allowed-origins",
                    "Origin",
                    "forbidden_origin",
                    "permission_error",
                )
            if (
                request.method == "OPTIONS"
                and origin is not None
                and "Access-Control-Request-Method" in request.headers
            ):
                return self.preflight(request, origin)
        needs_key = bool(self.api_keys) and (
            tcp or self.socket_requires_key or (request.method, request.path) in CONTROL
        )
        request[IDENTITY] = LOCAL
        auth = request.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        if not auth and "x-api-key" in request.headers:  # Anthropic's clients send the key this way
            scheme, token, auth = "bearer", request.headers["x-api-key"], "x-api-key"
        if self.api_keys and auth:
            self.reload_keys()
            at = match_key(token.strip(), self.api_keys) if scheme.lower() == "bearer" else None
            if at is not None:  # who it is, whether or not this listener needs a key
                request[IDENTITY] = self.key_names.get(self.api_keys[at], LOCAL)
        if needs_key:
            self.reload_keys()
            if request[IDENTITY] == LOCAL:
                self.refused["unauthorized"] += 1
                msg = (
                    "Authorization: a valid API key is required (header 'Authorization: Bearer KEY')"
                    if not auth
                    else "Authorization: the API key is not valid"
                )
                raise ApiError(
                    401, msg, "Authorization", "invalid_api_key", "authentication_error", {"WWW-Authenticate": "Bearer"}
                )
        if tcp and request.method in ("POST", "PUT", "PATCH"):
            given = request.content_type if "Content-Type" in request.headers else None
            if given not in JSON_TYPES:
                self.refused["unsupported_media_type"] += 1
                raise ApiError(
                    415,
                    f"Content-Type: the body must be application/json (got {given or 'no Content-Type'})",
                    "Content-Type",
                    "unsupported_media_type",
                )
        return None

    def preflight(self, request: web.Request, origin: str) -> web.Response:
        """The answer to a CORS preflight from an allowed origin: the methods this path takes, our two headers."""
        methods = self.methods_for(request)
        if not methods:
            raise ApiError(404, f"{request.path}: no such endpoint", None, "not_found")
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Origin": origin,
                "Vary": "Origin",
                "Access-Control-Allow-Methods": ", ".join(methods),
                "Access-Control-Allow-Headers": "Authorization, Content-Type, x-api-key, anthropic-version",
                "Access-Control-Max-Age": CORS_MAX_AGE,
            },
        )

    @staticmethod
    def methods_for(request: web.Request) -> list[str]:
        found = set()
        for resource in request.app.router.resources():
            if resource.canonical == request.path:
                found |= {route.method for route in resource}
        return sorted(found - {"HEAD", "OPTIONS", "*"})

    def cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or not self.allowed_origins:
            return
        if origin_of(origin) in self.allowed_origins or "*" in self.allowed_origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "X-Request-Id"
            response.headers.add("Vary", "Origin")

    def prometheus(self) -> bytes:
        """The refusal counters in Prometheus' text format."""
        lines = [
            "# HELP minibatch_http_refused_total Requests refused by the listener guard, by reason",
            "# TYPE minibatch_http_refused_total counter",
        ]
        lines += [f'minibatch_http_refused_total{{reason="{k}"}} {v}' for k, v in sorted(self.refused.items())]
        return ("\n".join(lines) + "\n").encode()


def is_tcp(request: web.Request) -> bool:
    """Whether the request arrived over TCP (anything that is not our Unix socket counts as TCP)."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return getattr(sock, "family", None) != socket.AF_UNIX


def guard_middleware(guard: Guard):
    @web.middleware
    async def guarded(request: web.Request, handler):
        answer = guard.check(request, is_tcp(request))
        if answer is not None:
            return answer
        return await handler(request)

    return guarded
