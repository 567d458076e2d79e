"""A fault-injecting HTTP/1.1 proxy for object-store tests: asyncio, standard library only.

    with FaultProxy(s3.endpoint, seed=3) as proxy:      # listens on 127.0.0.1, a free port
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # the client talks to the proxy
        proxy.add("reset_after", method="PUT", key=r"manifest\\.msgpack$", count=1)
        proxy.add("error", method="PUT", key=r"/c/", status=503, p=0.2)
        ...
        proxy.count(method="PUT", key=r"/c/")             # requests seen (any action)
        proxy.counts()                                    # {(method, action): n}

The proxy sits between a client (TensorStore's curl, aiobotocore's aiohttp) and one S3 server on
loopback (SeaweedFS). It reads each request whole (head and body, ``Content-Length`` or chunked;
it answers ``Expect: 100-continue`` itself), decides its fate by the first rule that matches and
fires, and forwards it verbatim on an upstream connection of its own, one per client connection
(keep-alive on both sides). Headers are never changed (SigV4 signs them, ``Host`` included, so the
server verifies the client's signature against the proxy's address as the client sent it); the
one action that alters a request changes one bit of its body only.

Actions (``ACTIONS``):

- ``error``: answer ``status`` (503 SlowDown by default, 429, 500, ...) without forwarding;
- ``reset``: reset the connection (RST) before forwarding: the server never sees the request;
- ``reset_after``: forward, read the server's whole answer, then reset the client's connection
  instead of relaying it (the server did it, the client never learns);
- ``error_after``: forward, then answer ``status`` (500 by default) instead of the server's answer;
- ``truncate``: forward, relay the answer's head and half of its body, then close;
- ``delay``: wait ``delay_s`` seconds, then forward;
- ``blackhole``: read the request, never answer, keep the connection open (until the client
  gives up, ``heal()`` or ``stop()``);
- ``flip``: flip one bit of the request body (inside its payload, not its framing) and forward.

A rule matches by method (a regex, full match, case-insensitive: ``"PUT"``, ``"GET|HEAD"``), by a
regex searched in the request's path (percent-decoded, no query: ``/bucket/prefix/key``), and
optionally by a regex searched in the query string. Among the requests it matches it skips the
first ``after``, then fires with probability ``p`` from the proxy's seeded RNG (a failing seed
reproduces the same draws for the same order of requests) at most ``count`` times. The first rule
that fires decides; a request no rule fires on is forwarded (``forward``).

The proxy binds 127.0.0.1 only and refuses an upstream anywhere but 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import collections
import random
import re
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

ACTIONS = ("error", "reset", "reset_after", "error_after", "truncate", "delay", "blackhole", "flip")
LOOPBACK = "127.0.0.1"
HEAD_LIMIT = 1 << 20  # the largest request or response head (and chunk-size line) accepted

_ERROR_CODES = {429: "TooManyRequests", 500: "InternalError", 502: "BadGateway", 503: "SlowDown",
                504: "GatewayTimeout"}
_REASONS = {429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway",
            503: "Service Unavailable", 504: "Gateway Timeout"}


class ProxyError(RuntimeError):
    pass


@dataclass
class Rule:
    action: str
    method: str | None = None
    key: str | None = None
    query: str | None = None
    p: float = 1.0
    count: int | None = None
    after: int = 0
    status: int | None = None
    delay_s: float = 0.0
    matched: int = 0  # requests it matched
    fired: int = 0  # times it decided a request's fate

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; actions: {', '.join(ACTIONS)}")
        self._method = re.compile(self.method, re.I) if self.method else None
        self._key = re.compile(self.key) if self.key else None
        self._query = re.compile(self.query) if self.query else None

    def matches(self, method: str, path: str, query: str) -> bool:
        return ((self._method is None or self._method.fullmatch(method) is not None)
                and (self._key is None or self._key.search(path) is not None)
                and (self._query is None or self._query.search(query) is not None))


@dataclass
class Record:
    """One request the proxy saw: what it did, and the status the client got (None: no answer)."""
    method: str
    path: str
    query: str
    action: str
    status: int | None
    time: float = field(default_factory=time.monotonic)


class _Request:
    def __init__(self, head: bytes, body: bytes, spans: list[tuple[int, int]]):
        self.head, self.body, self.spans = head, body, spans  # spans: payload (start, end) in body
        lines = head.split(b"\r\n")
        parts = lines[0].decode("latin-1").split(" ")
        if len(parts) != 3:
            raise ProxyError(f"bad request line {lines[0][:200]!r}")
        self.method, target, self.version = parts
        parsed = urllib.parse.urlsplit(target)
        self.path, self.query = urllib.parse.unquote(parsed.path), parsed.query
        self.headers = _headers(lines[1:])

    @property
    def close_after(self) -> bool:
        conn = self.headers.get("connection", "").lower()
        return "close" in conn or (self.version == "HTTP/1.0" and "keep-alive" not in conn)


def _headers(lines: list[bytes]) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in lines:
        if not line:
            continue
        name, _, value = line.decode("latin-1").partition(":")
        name = name.strip().lower()
        out[name] = (out[name] + ", " + value.strip()) if name in out else value.strip()
    return out


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    """A message head up to its blank line; None at a clean end of stream before any byte."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise


async def _read_chunked(reader: asyncio.StreamReader) -> tuple[bytes, list[tuple[int, int]]]:
    """A chunked body, raw (framing kept, to be relayed verbatim), and where its data lies."""
    raw, spans = bytearray(), []
    while True:
        line = await reader.readuntil(b"\r\n")
        raw += line
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, up to the blank line
                trailer = await reader.readuntil(b"\r\n")
                raw += trailer
                if trailer == b"\r\n":
                    return bytes(raw), spans
        spans.append((len(raw), len(raw) + size))
        raw += await reader.readexactly(size)
        raw += await reader.readexactly(2)


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> tuple[bytes, list[tuple[int, int]]]:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return await _read_chunked(reader)
    n = int(headers.get("content-length", "0") or "0")
    body = await reader.readexactly(n) if n else b""
    return body, [(0, n)] if n else []


def _aws_chunked_spans(body: bytes, start: int, end: int) -> list[tuple[int, int]]:
    """The data spans of an aws-chunked payload (``<hex size>;chunk-signature=...\\r\\n<data>\\r\\n``
    ..., then a 0-size chunk and trailers) within body[start:end]; [] if it does not parse."""
    spans, pos = [], start
    try:
        while pos < end:
            eol = body.index(b"\r\n", pos, end)
            size = int(body[pos:eol].split(b";", 1)[0], 16)
            if size == 0:
                return spans
            spans.append((eol + 2, eol + 2 + size))
            pos = eol + 2 + size + 2
    except ValueError:
        return []
    return spans


class FaultProxy:
    """The proxy; ``start()``/``stop()`` or a context manager. Runs its event loop on a thread of
    its own, so synchronous tests (and the library's own threads) can use it."""

    def __init__(self, upstream: str, *, seed: int = 0):
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or parsed.hostname != LOOPBACK or not parsed.port:
            raise ProxyError(f"the upstream must be http://{LOOPBACK}:<port>, not {upstream!r}")
        self.upstream = (LOOPBACK, parsed.port)
        self.endpoint = ""
        self.port = 0
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._rng = random.Random(seed)
        self.seed = seed
        self.log: list[Record] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._held: set[asyncio.StreamWriter] = set()  # black-holed client connections
        self._tasks: set[asyncio.Task] = set()

    # ---- control (any thread) ----------------------------------------------------------------

    def add(self, action: str, *, method: str | None = None, key: str | None = None, query: str | None = None,
            p: float = 1.0, count: int | None = None, after: int = 0, status: int | None = None,
            delay_s: float = 0.0) -> Rule:
        """A rule (module docstring); later rules are consulted after earlier ones."""
        if status is None and action in ("error", "error_after"):
            status = 503 if action == "error" else 500
        rule = Rule(action, method, key, query, p, count, after, status, delay_s)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self, *, seed: int | None = None) -> None:
        """No rules, an empty log; the RNG reseeded (with `seed`, else the current seed)."""
        with self._lock:
            self._rules.clear()
            self.log.clear()
            if seed is not None:
                self.seed = seed
            self._rng = random.Random(self.seed)

    def heal(self) -> None:
        """No rules from now on, and every black-holed connection reset (its client sees an error
        and, retrying, reaches the server): lets a stuck client finish."""
        with self._lock:
            self._rules.clear()
        if self._loop is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._release_held(), self._loop).result(10)

    def records(self, *, method: str | None = None, key: str | None = None, action: str | None = None) -> list[Record]:
        m = re.compile(method, re.I) if method else None
        k = re.compile(key) if key else None
        with self._lock:
            log = list(self.log)
        return [r for r in log if (m is None or m.fullmatch(r.method)) and (k is None or k.search(r.path))
                and (action is None or r.action == action)]

    def count(self, *, method: str | None = None, key: str | None = None, action: str | None = None) -> int:
        """Requests seen that match (method regex, path regex, action), whatever their fate."""
        return len(self.records(method=method, key=key, action=action))

    def counts(self) -> dict[tuple[str, str], int]:
        """Requests seen so far by (method, action); ``forward`` for those passed through as is."""
        with self._lock:
            return dict(collections.Counter((r.method, r.action) for r in self.log))

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "FaultProxy":
        if self._thread is not None:
            raise ProxyError("already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faultproxy", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, LOOPBACK, 0, limit=HEAD_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]
        self.endpoint = f"http://{LOOPBACK}:{self.port}"

    def stop(self) -> None:
        if self._loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self._loop.close()
            self._loop = self._thread = None

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._conns):
            _reset(writer)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self._server is not None:
            await self._server.wait_closed()

    async def _release_held(self) -> None:
        for writer in list(self._held):
            _reset(writer)
        self._held.clear()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the connection loop (event-loop thread) -------------------------------------------------

    def _decide(self, req: _Request) -> Rule | None:
        with self._lock:
            for rule in self._rules:
                if not rule.matches(req.method, req.path, req.query):
                    continue
                rule.matched += 1
                if rule.matched <= rule.after or (rule.count is not None and rule.fired >= rule.count):
                    continue
                if rule.p >= 1.0 or self._rng.random() < rule.p:
                    rule.fired += 1
                    return rule
        return None

    def _record(self, req: _Request, action: str, status: int | None) -> None:
        with self._lock:
            self.log.append(Record(req.method, req.path, req.query, action, status))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self._conns.add(writer)
        upstream: list = [None]  # (reader, writer) of this client connection's server connection
        try:
            while True:
                head = await _read_head(reader)
                if head is None:
                    break
                req = _Request(head, b"", [])
                if "100-continue" in req.headers.get("expect", "").lower():
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                req.body, req.spans = await _read_body(reader, req.headers)
                keep = await self._handle(req, reader, writer, upstream)
                if not keep or req.close_after:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ProxyError, ValueError):
            _reset(writer)
        except asyncio.CancelledError:
            _reset(writer)
        finally:
            self._conns.discard(writer)
            self._held.discard(writer)
            self._tasks.discard(task)
            if upstream[0] is not None:
                upstream[0][1].close()
            if not writer.is_closing():
                writer.close()

    async def _handle(self, req: _Request, reader, writer, upstream: list) -> bool:
        """Serve one request; whether the client connection stays open for the next."""
        rule = self._decide(req)
        action = rule.action if rule else "forward"
        if action == "error":
            self._record(req, action, rule.status)
            await _answer(writer, req, rule.status)
            return True
        if action == "reset":
            self._record(req, action, None)
            _reset(writer)
            return False
        if action == "blackhole":
            self._record(req, action, None)
            self._held.add(writer)
            while await reader.read(65536):  # until the client gives up (or heal/stop resets it)
                pass
            return False
        if action == "delay":
            await asyncio.sleep(rule.delay_s)
        body = req.body
        if action == "flip":
            body = self._flip(req)
        try:
            status, head, rbody, close = await self._forward(req, body, upstream)
        except (ConnectionError, asyncio.IncompleteReadError, ProxyError, ValueError, OSError):
            # The server went away mid-request: the client sees what a broken server gives.
            self._record(req, f"{action}:upstream-failed", None)
            _reset(writer)
            return False
        if action == "reset_after":
            self._record(req, action, None)
            _reset(writer)
            return False
        if action == "error_after":
            self._record(req, action, rule.status)
            await _answer(writer, req, rule.status)
            return True
        if action == "truncate":
            self._record(req, action, status)
            writer.write(head + rbody[: len(rbody) // 2])
            await writer.drain()
            writer.close()  # a FIN after the short body (a reset could discard what was sent)
            return False
        self._record(req, action, status)
        writer.write(head + rbody)
        await writer.drain()
        return not close

    def _flip(self, req: _Request) -> bytes:
        """The body with one bit flipped, at a seeded position inside its payload."""
        spans = []
        for start, end in req.spans:
            inner = _aws_chunked_spans(req.body, start, end) \
                if "aws-chunked" in req.headers.get("content-encoding", "").lower() \
                or req.headers.get("x-amz-content-sha256", "").startswith("STREAMING-") else []
            spans += inner or [(start, end)]
        spans = [(s, e) for s, e in spans if e > s]
        if not spans:
            return req.body
        with self._lock:
            start, end = spans[self._rng.randrange(len(spans))]
            lo, hi = start + (end - start) // 4, start + max(1, 3 * (end - start) // 4)
            pos, bit = self._rng.randrange(lo, hi), self._rng.randrange(8)
        body = bytearray(req.body)
        body[pos] ^= 1 << bit
        return bytes(body)

    async def _forward(self, req: _Request, body: bytes, upstream: list) -> tuple[int, bytes, bytes, bool]:
        """Send the request to the server (verbatim but for `body`); (status, head, body, close)
        of its final answer (1xx interim answers skipped). Reconnects once if a kept-alive
        upstream connection turns out closed before answering."""
        for attempt in (0, 1):
            if upstream[0] is None or upstream[0][0].at_eof():
                if upstream[0] is not None:
                    upstream[0][1].close()
                upstream[0] = await asyncio.open_connection(*self.upstream, limit=HEAD_LIMIT)
            ureader, uwriter = upstream[0]
            try:
                uwriter.write(req.head + body)
                await uwriter.drain()
                head = await _read_head(ureader)
                while head is not None and _status(head) // 100 == 1 and _status(head) != 101:
                    head = await _read_head(ureader)
            except ConnectionError:
                head = None
            if head is None:
                uwriter.close()
                upstream[0] = None
                if attempt == 0:
                    continue
                raise ProxyError("the server closed the connection without answering")
            status = _status(head)
            headers = _headers(head.split(b"\r\n")[1:])
            close = "close" in headers.get("connection", "").lower()
            if req.method == "HEAD" or status in (204, 304):
                rbody = b""
            elif "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" in headers:
                rbody, _ = await _read_body(ureader, headers)
            else:
                rbody, close = await ureader.read(), True  # delimited by the end of the stream
            if close:
                uwriter.close()
                upstream[0] = None
            return status, head, rbody, close
        raise AssertionError("unreachable")


def _status(head: bytes) -> int:
    try:
        return int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise ProxyError(f"bad status line {head[:200]!r}") from None


async def _answer(writer: asyncio.StreamWriter, req: _Request, status: int) -> None:
    """An S3-style error answer, the connection kept alive."""
    code = _ERROR_CODES.get(status, "InternalError")
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected by faultproxy</Message><Resource>{req.path}</Resource>"
            "<RequestId>faultproxy</RequestId></Error>").encode()
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nx-amz-request-id: faultproxy\r\n\r\n").encode()
    writer.write(head if req.method == "HEAD" else head + body)
    await writer.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), not a FIN: the peer sees 'connection reset'."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()
