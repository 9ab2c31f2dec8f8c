"""A POST on a raw socket, its reply left unread: the API tests hang up (or read) when they like, as a client that
leaves or a slow one does."""

from __future__ import annotations

import json
import socket


def send_request(port: int, path: str, body: dict, key: str | None, timeout: float) -> socket.socket:
    """POST `body` as JSON to `path` on 127.0.0.1:`port` (with `key` as the bearer token where given)."""
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(head.encode() + data)
    return sock
