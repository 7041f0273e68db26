"""Raw-socket helpers for the HTTP-layer tests and the fuzz suite: requests no HTTP client
library would send (bad request lines, half-sent heads, slow bodies)."""
import json
import socket
import time
from urllib.parse import urlparse


def address(url):
    u = urlparse(url)
    return u.hostname, u.port


def raw(url, data, timeout=15.0, shut=False):
    """Sends `data` as is and returns (status, headers, body) of the reply (status None: none)."""
    s = socket.create_connection(address(url), timeout=timeout)
    try:
        if data:
            s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            out += chunk
    finally:
        s.close()
    return parse(out)


def parse(out):
    if not out.startswith(b"HTTP/1.1 "):
        return None, {}, out
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return status, headers, body


def dechunk(body):
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size.split(b";")[0] or b"0", 16)
        if n == 0:
            break
        out += rest[:n]
        body = rest[n + 2:]
    return out


def request(method, path, body=b"", headers=None, host="localhost"):
    h = {"Host": host, "Content-Length": str(len(body)), "Connection": "close", **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    return head.encode("latin-1") + body


def error_shape_ok(path, status, body):
    """Whether `body` is an error in the API's shape for `path` (Anthropic's under /v1/messages)."""
    try:
        b = json.loads(body)
    except ValueError:
        return False
    if path.startswith("/v1/messages"):
        return b.get("type") == "error" and set(b.get("error", {})) == {"type", "message"}
    e = b.get("error")
    return isinstance(e, dict) and set(e) == {"message", "type", "param", "code"} and isinstance(e["message"], str)


def timed_health(url, timeout=5.0):
    """Seconds /health took (a fresh connection each time, as a monitor would)."""
    t = time.monotonic()
    status, _, body = raw(url, request("GET", "/health"), timeout=timeout)
    assert status == 200, (status, body)
    return time.monotonic() - t


def rss_peak_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0
