"""A small fault-injecting HTTP proxy for the object-store tests (127.0.0.1 only).

It sits between the S3 client and the server and understands just enough HTTP/1.1 to act on
one request at a time (request head, ``Content-Length`` body; anything else is piped raw).
Faults are a bounded plan: a list of ``Fault`` entries, each matching requests by method and
a substring of the target, each firing ``times`` times and then spent. After the plan is
spent the proxy passes everything through. It stops itself after ``lifetime_s`` seconds
(or on :meth:`FaultProxy.stop` / leaving the ``with`` block), closing every connection.

Fault kinds:
- ``reset``: the client connection is reset (RST) before the request reaches the server.
- ``reset_after``: the request is applied by the server, then the client connection is reset
  before the response arrives (the client cannot tell whether its write happened).
- ``drop``: the client connection is closed (FIN) without a response.
- ``delay``: the request waits ``delay_s`` seconds before being forwarded.
- ``slowdown``: a ``503 SlowDown`` response is sent and the server never sees the request.
- ``strip``: the request is forwarded without its ``header`` header (a gateway that drops
  ``If-None-Match``). The header is signed, so only a server that does not check
  signatures (moto_server) takes such a request.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass

_SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                  b"<Message>Please reduce your request rate.</Message></Error>")


@dataclass
class Fault:
    """One planned fault: ``kind`` on the next ``times`` requests matching method and target."""

    kind: str
    method: str = ""       # "" matches any method
    target: str = ""       # substring of the request target; "" matches any
    times: int = 1
    delay_s: float = 0.0
    header: str = ""       # for ``strip``: the request header to drop
    fired: int = 0

    def matches(self, method: str, target: str) -> bool:
        """Whether this fault applies to a request (and is not yet spent)."""
        return (self.fired < self.times and (not self.method or self.method == method)
                and self.target in target)


class _Closed(Exception):
    pass


def _read_head(sock: socket.socket, buf: bytearray) -> bytes:
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise _Closed
        buf += chunk
    i = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:i])
    del buf[:i]
    return head


def _read_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        chunk = sock.recv(max(65536, n - len(buf)))
        if not chunk:
            raise _Closed
        buf += chunk
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    hdrs: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            hdrs[k.strip().lower()] = v.strip()
    return lines[0], hdrs


def _reset(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class FaultProxy:
    """Proxy ``127.0.0.1:<port>`` -> ``127.0.0.1:<upstream_port>`` with a fault plan."""

    def __init__(self, upstream_port: int, faults: list[Fault] | None = None, *,
                 lifetime_s: float = 120.0) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.faults = list(faults or [])
        self.requests: list[tuple[str, str]] = []   # (method, target) of every request seen
        self.fired: list[tuple[str, str, str]] = []  # (kind, method, target)
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._deadline = time.monotonic() + lifetime_s
        self._thread = threading.Thread(target=self._accept, name="faultproxy", daemon=True)
        self._thread.start()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def plan(self, *faults: Fault) -> None:
        """Replace the fault plan."""
        with self._lock:
            self.faults = list(faults)

    def stop(self) -> None:
        """Stop accepting and close every connection. Idempotent."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            socks = list(self._socks)
            self._socks.clear()
        for s in socks:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        try:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                try:
                    client, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    break
                with self._lock:
                    self._socks.add(client)
                threading.Thread(target=self._serve, args=(client,), daemon=True).start()
        finally:
            self._listener.close()
            self._stop.set()

    def _pick(self, method: str, target: str) -> Fault | None:
        with self._lock:
            self.requests.append((method, target))
            for f in self.faults:
                if f.matches(method, target):
                    f.fired += 1
                    self.fired.append((f.kind, method, target))
                    return f
        return None

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        cbuf, ubuf = bytearray(), bytearray()
        try:
            client.settimeout(30)
            while not self._stop.is_set():
                head = _read_head(client, cbuf)
                line, hdrs = _headers(head)
                method, target = [*line.split(" "), "", ""][:2]
                if "100-continue" in hdrs.get("expect", "").lower():
                    # answer the client's Expect ourselves (the body is read before the
                    # request is forwarded) and forward the request without it
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = b"\r\n".join(h for h in head.split(b"\r\n")
                                         if not h.lower().startswith(b"expect:"))
                if upstream is None:
                    upstream = socket.create_connection(self.upstream, timeout=30)
                    ubuf.clear()
                    with self._lock:
                        self._socks.add(upstream)
                if "chunked" in hdrs.get("transfer-encoding", ""):
                    # not parsed: pipe the rest of this connection raw
                    upstream.sendall(head + bytes(cbuf))
                    self._pipe(client, upstream)
                    return
                body = _read_exact(client, cbuf, int(hdrs.get("content-length", "0")))
                fault = self._pick(method, target)
                kind = fault.kind if fault else ""
                if kind == "reset":
                    _reset(client)
                    return
                if kind == "drop":
                    client.close()
                    return
                if kind == "slowdown":
                    client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml"
                                   b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                                   % len(_SLOWDOWN_BODY) + _SLOWDOWN_BODY)
                    client.close()
                    return
                if kind == "delay" and fault is not None:
                    time.sleep(fault.delay_s)
                if kind == "strip" and fault is not None:
                    drop = fault.header.lower().encode() + b":"
                    head = b"\r\n".join(h for h in head.split(b"\r\n")
                                         if not h.lower().startswith(drop))
                upstream.sendall(head + body)
                while True:  # skip interim (1xx) responses
                    rhead = _read_head(upstream, ubuf)
                    status, rh = _headers(rhead)
                    code = int(status.split(" ")[1])
                    if not 100 <= code < 200:
                        break
                if method == "HEAD" or code in (204, 304):
                    rbody = b""
                elif "content-length" in rh:
                    rbody = _read_exact(upstream, ubuf, int(rh["content-length"]))
                else:
                    client.sendall(rhead + bytes(ubuf))
                    self._pipe(client, upstream)
                    return
                if kind == "reset_after":
                    _reset(client)
                    return
                client.sendall(rhead + rbody)
                if rh.get("connection", "").lower() == "close":
                    upstream.close()
                    with self._lock:
                        self._socks.discard(upstream)
                    upstream = None
        except (_Closed, OSError):
            pass
        finally:
            for s in (client, upstream):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
                    with self._lock:
                        self._socks.discard(s)

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        def one(src: socket.socket, dst: socket.socket) -> None:
            try:
                while True:
                    d = src.recv(65536)
                    if not d:
                        break
                    dst.sendall(d)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        t = threading.Thread(target=one, args=(b, a), daemon=True)
        t.start()
        one(a, b)
        t.join(timeout=30)
