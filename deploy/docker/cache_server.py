#!/usr/bin/python3
"""Serves a Bazel disk cache (--disk_cache layout: ac/XX/HASH, cas/XX/HASH) read-only over Bazel's
HTTP cache protocol (GET/HEAD /ac/HASH, /cas/HASH), so that a `bazel build` inside `docker build`
can take the host's cached actions (deploy/docker/build-image.sh --seed-cache). Uploads are refused.
Standard library only.
"""
import argparse
import http.server
import os
import re
import sys

PATH_RE = re.compile(r"^/(?:[^/]*/)*?(ac|cas)/([0-9a-f]{64})$")


def make_handler(root):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _file(self):
            m = PATH_RE.match(self.path.split("?", 1)[0])
            if not m:
                return None
            kind, digest = m.groups()
            path = os.path.join(root, kind, digest[:2], digest)
            return path if os.path.isfile(path) else None

        def _reply(self, body):
            path = self._file()
            if path is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            size = os.path.getsize(path)
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            if body:
                with open(path, "rb") as f:
                    while True:
                        chunk = f.read(1 << 20)
                        if not chunk:
                            break
                        self.wfile.write(chunk)

        def do_GET(self):
            self._reply(True)

        def do_HEAD(self):
            self._reply(False)

        def do_PUT(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            self.send_response(405)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    return Handler


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True, help="the disk cache directory")
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="preferred port (taken: any free one)")
    parser.add_argument("--port-file", help="write the port here once listening")
    args = parser.parse_args()
    handler = make_handler(os.path.abspath(args.root))
    try:
        server = http.server.ThreadingHTTPServer((args.bind, args.port), handler)
    except OSError:  # the preferred port is taken: any free one
        server = http.server.ThreadingHTTPServer((args.bind, 0), handler)
    server.daemon_threads = True
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(server.server_address[1]))
        os.rename(args.port_file + ".tmp", args.port_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
