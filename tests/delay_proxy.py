"""An HTTP proxy that holds every request for a fixed time before passing it on: a slow tracker made from a real
one (the MLflow server of tests/mlflow_server.py behind it), for the tracking-overhead benchmark and tests.

    python -m tests.delay_proxy --target http://127.0.0.1:5000 --delay 0.5 --port 5001

It runs in its own process (`start`), so its threads never share the trainer's interpreter lock.
"""

from __future__ import annotations

import argparse
import http.client
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.ranks import free_port, wait_until

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def handler(target: str, delay: float) -> type[BaseHTTPRequestHandler]:
    parsed = urllib.parse.urlsplit(target)

    class Delayed(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            time.sleep(delay)  # the tracker's latency, before the request reaches it
            conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                response = conn.getresponse()
                data = response.read()
            finally:
                conn.close()
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in HOP_HEADERS:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

        def log_message(self, *args) -> None:  # quiet: one line per request would flood the benchmark's output
            pass

    return Delayed


@dataclass
class DelayProxy:
    uri: str
    process: subprocess.Popen

    def stop(self) -> None:
        from tests.mlflow_server import stop_process

        stop_process(self.process)


def start(target: str, delay: float) -> DelayProxy:
    """The proxy in a child process, once it answers (through to the target's /health)."""
    from tests.mlflow_server import healthy

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.delay_proxy", "--target", target, "--delay",
                                str(delay), "--port", str(port)], start_new_session=True)
    proxy = DelayProxy(f"http://127.0.0.1:{port}", process)
    try:
        wait_until("the delaying proxy", lambda: healthy(proxy.uri), timeout=120,
                   alive=lambda: process.poll() is None)
    except BaseException:
        proxy.stop()
        raise
    return proxy


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--delay", type=float, required=True, help="seconds each request is held")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler(args.target, args.delay))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
