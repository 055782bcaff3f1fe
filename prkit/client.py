"""A small keep-alive HTTP/1.1 client for talking to Envoy in tests, and its replies (with the
filter's decision header parsed)."""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass

from .fake_workers import DEBUG_HEADER


def parse_decision(value: str) -> dict:
    """A decision debug header's value: {'worker':..., 'reason':..., 'matched': int, 'total': int,
    and 'holder', 'held' (int), 'holder_load' where present}."""
    out = {}
    for part in value.split(";"):
        k, _, val = part.strip().partition("=")
        out[k] = int(val) if k in ("matched", "total", "held") and val.isdigit() else val
    return out


@dataclass
class Reply:
    status: int
    headers: dict  # lower-case name -> list of values
    body: bytes

    @property
    def worker(self) -> str | None:
        v = self.headers.get("x-worker-id")
        return v[0] if v else None

    @property
    def decision(self) -> dict:
        """The debug header parsed (parse_decision)."""
        v = self.headers.get(DEBUG_HEADER)
        return parse_decision(v[0]) if v else {}

    def json(self):
        return json.loads(self.body)


class Client:
    """A keep-alive HTTP/1.1 client (http.client) that allows duplicate/odd-case headers."""

    def __init__(self, port: int, timeout: float = 30.0):
        self.port = port
        self.timeout = timeout
        self.conn = None

    def request(self, method: str, path: str, body=None, headers=None) -> Reply:
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        elif isinstance(body, str):
            body = body.encode()
        hdrs = list(headers or [])
        if isinstance(headers, dict):
            hdrs = list(headers.items())
        for attempt in (0, 1):
            reused = self.conn is not None
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            try:
                self.conn.putrequest(method, path, skip_accept_encoding=True)
                names = {k.lower() for k, _ in hdrs}
                if body is not None:
                    if "content-type" not in names:
                        self.conn.putheader("Content-Type", "application/json")
                    self.conn.putheader("Content-Length", str(len(body)))
                for k, v in hdrs:
                    self.conn.putheader(k, v)
                self.conn.endheaders(body)
                r = self.conn.getresponse()
                data = r.read()
                h: dict = {}
                for k, v in r.getheaders():
                    h.setdefault(k.lower(), []).append(v)
                if r.will_close:
                    self.close()
                return Reply(r.status, h, data)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # Only a reused keep-alive connection that Envoy closed while idle is retried
                # (once, on a fresh connection); any other failure is the test's business.
                self.close()
                if attempt or not reused:
                    raise
        raise AssertionError("unreachable")

    def request_chunked(self, method: str, path: str, parts: list, headers=None) -> Reply:
        """Send the body with Transfer-Encoding: chunked, one chunk per part (fresh connection)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        try:
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=iter(parts), headers=hdrs, encode_chunked=True)
            r = conn.getresponse()
            data = r.read()
            h: dict = {}
            for k, v in r.getheaders():
                h.setdefault(k.lower(), []).append(v)
            return Reply(r.status, h, data)
        finally:
            conn.close()

    def post(self, path, body, headers=None) -> Reply:
        return self.request("POST", path, body, headers)

    def get(self, path, headers=None) -> Reply:
        return self.request("GET", path, None, headers)

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None
