"""An HTTP proxy that makes an S3 server flaky as object stores are: some requests answered
with S3's own ``503 SlowDown`` (or ``500 InternalError``) error, some responses cut off
mid-body, the connection dropped. The rates are the test's, drawn from a seeded RNG; every
request, fault and byte is counted, so a test knows what was injected and what its client
fetched again.

It speaks just enough HTTP/1.1 to find where each request and response ends (a length, a
chunked body, or the connection's end) and passes every byte through as it came."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# S3's own answers (docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html).
ERRORS = {
    "throttle": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "error": (500, "Internal Server Error", "InternalError",
              "We encountered an internal error. Please try again."),
}  # fmt: skip
FAULTS = ("throttle", "error", "drop")
# What the slow tests' runs on the store meet: S3's 503 SlowDown for 3% of requests, and 1%
# of responses cut off mid-body, as a busy bucket behind a flaky network does.
FLAKY = {"throttle": 0.03, "drop": 0.01}


@dataclass
class Exchange:
    """One request the proxy saw: what it was (and the byte range it asked for), the fault
    injected (or None), the status the client got, and the bytes of the response body
    sent of the body's length."""

    method: str
    target: str
    range: str | None
    fault: str | None
    status: int
    sent: int
    length: int


class Message:
    """The head of a request or a response, as it came, and the fields a proxy reads."""

    def __init__(self, head: bytes):
        self.head = head
        lines = head.decode("latin-1").split("\r\n")
        self.start = lines[0].split(" ", 2)
        self.headers = {}
        for line in lines[1:]:
            if ":" in line:
                key, value = line.split(":", 1)
                self.headers[key.strip().lower()] = value.strip()

    def has(self, header: str, value: str) -> bool:
        return value in self.headers.get(header, "").lower()

    def without(self, header: str) -> bytes:
        """The head with ``header`` taken out."""
        lines = self.head.split(b"\r\n")
        keep = [ln for ln in lines if not ln.lower().startswith(header.encode() + b":")]
        return b"\r\n".join(keep)


def read_head(f: Any) -> bytes | None:
    """Bytes up to the blank line that ends a message's head; None at a clean end."""
    lines = []
    while True:
        line = f.readline(65537)
        if not line:
            if lines:
                raise ConnectionError("the connection ended inside a message's head")
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def read_body(f: Any, msg: Message, bodiless: bool = False) -> tuple[bytes, bool]:
    """The body as it came (a chunked one with its framing) and whether it ran to the
    connection's end (no length given)."""
    if bodiless:
        return b"", False
    if msg.has("transfer-encoding", "chunked"):
        parts = []
        while True:
            size_line = f.readline(65537)
            parts.append(size_line)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (trailer := f.readline(65537)) not in (b"\r\n", b"\n", b""):
                    parts.append(trailer)
                parts.append(b"\r\n")
                return b"".join(parts), False
            parts.append(_exactly(f, size + 2))
    if "content-length" in msg.headers:
        return _exactly(f, int(msg.headers["content-length"])), False
    if msg.start[0].startswith("HTTP/"):  # a response without a length: to the end
        return f.read(), True
    return b"", False


def _exactly(f: Any, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ConnectionError(f"the connection ended {n - len(data)} bytes short of a body")
    return data


def error_reply(fault: str, target: str, head_only: bool) -> bytes:
    status, reason, code, message = ERRORS[fault]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{target.split('?')[0]}</Resource>"
        "<RequestId>4442587FB7D0A2F9</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nx-amz-request-id: 4442587FB7D0A2F9\r\n\r\n"
    ).encode()
    return head if head_only else head + body


class FaultProxy:
    """A proxy on 127.0.0.1 in front of the S3 server at ``upstream`` (``http://host:port``).

    Each request draws, from ``random.Random(seed)``, one of: an S3 ``503 SlowDown`` error
    (``throttle``), a ``500 InternalError`` (``error``), both answered without reaching the
    server; a ``drop`` (forwarded, and the response cut off after its head and part of its
    body, or before anything when it has no body, then the connection closed); or nothing.
    ``rates`` holds the share of each; ``force`` injects the next faults on cue.
    ``counts``: requests, throttle, error, drop, served (every byte sent back), body (the
    bytes of response bodies sent); ``exchanges``: each request, in order."""

    def __init__(self, upstream: str, seed: int = 0, **rates: float):
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.rng = random.Random(seed)
        self.rates: dict[str, float] = {}
        self.set_rates(**rates)
        self.counts: Counter[str] = Counter()
        self.exchanges: list[Exchange] = []
        self._forced: list[tuple[str, Callable[[str, str, str | None], bool]]] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    def set_rates(self, **rates: float) -> None:
        unknown = set(rates) - set(FAULTS)
        assert not unknown and sum(rates.values()) <= 1, rates
        self.rates = {fault: float(rates.get(fault, 0.0)) for fault in FAULTS}

    @contextlib.contextmanager
    def faults(self, seed: int = 0, **rates: float) -> Iterator[Counter[str]]:
        """These rates for the block, then none; yields the counts of the block's own."""
        with self._lock:
            self.rng.seed(seed)
            before = Counter(self.counts)
        self.set_rates(**rates)
        during: Counter[str] = Counter()
        try:
            yield during
        finally:
            self.set_rates()
            with self._lock:
                during.update(self.counts - before)

    def force(
        self, fault: str, times: int = 1, when: Callable[[str, str, str | None], bool] | None = None
    ) -> None:
        """The next ``times`` requests for which ``when(method, target, range)`` holds (the
        Range header's value, or None) get ``fault``."""
        assert fault in FAULTS, fault
        with self._lock:
            self._forced += [(fault, when or (lambda m, t, r: True))] * times

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.exchanges.clear()
            self._forced.clear()

    def close(self) -> None:
        self._listener.close()

    # ------------------------------------------------------------ the connections

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _draw(self, method: str, target: str, asked: str | None) -> str | None:
        with self._lock:
            self.counts["requests"] += 1
            for i, (fault, when) in enumerate(self._forced):
                if when(method, target, asked):
                    del self._forced[i]
                    self.counts[fault] += 1
                    return fault
            roll, edge = self.rng.random(), 0.0
            for fault in FAULTS:
                edge += self.rates[fault]
                if roll < edge:
                    self.counts[fault] += 1
                    return fault
        return None

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            reader = client.makefile("rb")
            while True:
                head = read_head(reader)
                if head is None:
                    return
                request = Message(head)
                if request.has("expect", "100-continue"):
                    # Answered here, so that the server sees a plain request.
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = request.without("expect")
                body, _ = read_body(reader, request)
                asked = (request.start[0], request.start[1], request.headers.get("range"))
                method, target = asked[0], asked[1]
                fault = self._draw(*asked)
                if fault in ERRORS:
                    self._record(*asked, fault, ERRORS[fault][0], 0, 0)
                    self._send(client, error_reply(fault, target, method == "HEAD"), 0)
                    continue
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    upstream_reader = upstream.makefile("rb")
                upstream.sendall(head + body)
                if not self._relay(client, upstream_reader, asked, fault):
                    return
                if fault == "drop":
                    return
        except (OSError, ValueError, IndexError):
            return
        finally:
            for s in (client, upstream):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)
                    s.close()

    def _relay(self, client: socket.socket, reader: Any, asked: tuple[str, str, str | None],
               fault: str | None) -> bool:  # fmt: skip
        """The server's response, whole or (``drop``) cut off; whether the connection lives on."""
        method = asked[0]
        head = read_head(reader)
        if head is None:
            raise ConnectionError("the server closed the connection")
        response = Message(head)
        status = int(response.start[1])
        bodiless = method == "HEAD" or status in (204, 304) or status < 200
        body, to_end = read_body(reader, response, bodiless)
        if fault == "drop":
            with self._lock:
                cut = self.rng.randint(1, len(body) - 1) if len(body) > 1 else 0
            self._record(*asked, fault, status, cut, len(body))
            if cut:
                self._send(client, head + body[:cut], cut)
            return False
        self._record(*asked, None, status, len(body), len(body))
        self._send(client, head + body, len(body))
        return not (to_end or response.has("connection", "close"))

    def _send(self, client: socket.socket, data: bytes, body: int) -> None:
        # Counted (and recorded, by the caller) first: the client may look as soon as it has it.
        with self._lock:
            self.counts["served"] += len(data)
            self.counts["body"] += body
        client.sendall(data)

    def _record(self, method: str, target: str, asked: str | None, fault: str | None,
                status: int, sent: int, length: int) -> None:  # fmt: skip
        with self._lock:
            self.exchanges.append(Exchange(method, target, asked, fault, status, sent, length))


def start_moto(env: dict[str, str] | None = None) -> tuple[Any, str]:
    """moto's S3 server on a free port of 127.0.0.1 (with ``env`` added to its
    environment), once it answers: the process and its endpoint."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    exe = str(Path(sys.executable).with_name("moto_server"))
    server = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            return server, endpoint
        except urllib.error.HTTPError:  # it answers, and refuses (auth is on)
            return server, endpoint
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError(f"moto_server did not answer on {endpoint}") from None
            time.sleep(0.2)


def stop(server: Any) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
