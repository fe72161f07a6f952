"""A local stand-in for the EC2 instance metadata service that speaks its protocol (IMDSv1 and IMDSv2), plus
the ways a real one goes wrong: v1 only, silent, slow, garbage, a token answer lost to the hop limit.

Only ever binds 127.0.0.1; tests point AWS_EC2_METADATA_SERVICE_ENDPOINT at it.
"""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

TOKEN = "AQAEAFakeTokenForTestsOnly0123456789abcdefABCDEF_-=="
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"


@dataclass
class Behaviour:
    mode: str = "v2"  # v2 | v2-optional | v1 | slow | garbage | garbage-token | garbage-type | hop-limit
    instance_type: str = "ml.p4d.24xlarge"
    delay: float = 0.0  # seconds before every answer in "slow" mode
    refuse_status: int = 403  # what "v1" answers to the token PUT
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


def _handler(behaviour: Behaviour) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep test output clean
            pass

        def _send(self, status: int, body: str = "") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _garbled(self, garbage: bytes) -> bool:
            """Record the request and apply the modes that treat every request alike; True: answered."""
            behaviour.requests.append((self.command, self.path, dict(self.headers.items())))
            if behaviour.mode == "slow":
                behaviour.stop.wait(behaviour.delay)
            if behaviour.mode != "garbage":
                return False
            self.wfile.write(garbage)
            self.close_connection = True
            return True

        def do_PUT(self) -> None:
            if self._garbled(b"\x00\xff\xfeSSH-2.0-not-http\r\n\r\n"):
                return
            mode = behaviour.mode
            if mode == "hop-limit":
                behaviour.stop.wait(30)  # the answer never arrives
                return
            if self.path != "/latest/api/token":
                return self._send(404)
            if mode == "v1":
                return self._send(behaviour.refuse_status)
            ttl = self.headers.get(TTL_HEADER, "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return self._send(400)  # what IMDS answers to a PUT without a valid TTL
            if mode == "garbage-token":
                return self._send(200, "<html><body>Welcome to nginx!</body></html>")
            self._send(200, TOKEN)

        def do_GET(self) -> None:
            if self._garbled(b"\x00\xff\xfe garbage \r\n\r\n"):
                return
            mode = behaviour.mode
            token = self.headers.get(TOKEN_HEADER)
            tokens_required = mode in ("v2", "slow", "garbage-type")
            if token is not None and token != TOKEN:
                return self._send(401)
            if token is None and tokens_required:
                return self._send(401)
            if self.path != "/latest/meta-data/instance-type":
                return self._send(404)
            if mode == "garbage-type":
                return self._send(200, "<?xml version='1.0'?><Error>Nope</Error>")
            self._send(200, behaviour.instance_type)

    return Handler


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        # The client gave up (that is what timeouts are for); writing into its closed socket is expected.
        pass


@contextmanager
def imds_server(**kwargs: object) -> Iterator[tuple[str, Behaviour]]:
    """A running server; yields its endpoint URL and its (mutable) behaviour."""
    behaviour = Behaviour(**kwargs)  # type: ignore[arg-type]
    server = _QuietServer(("127.0.0.1", 0), _handler(behaviour))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", behaviour
    finally:
        behaviour.stop.set()
        server.shutdown()
        server.server_close()


@contextmanager
def silent_server() -> Iterator[str]:
    """Accepts connections (the kernel completes the handshake) and never reads or answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def closed_port() -> str:
    """An endpoint where nothing listens: connecting is refused at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"
