"""A Hub on localhost for the download tests: the few routes huggingface_hub calls to resolve
a dataset's revision, list its files and download one (HEAD, then GET with a Range to resume),
serving files from a dict, and its card's metadata (``card``) with its info. A file named in ``cut`` is cut off half-way the first time it is
served (its full length promised, the connection closed), as a broken link does; every
request is logged with its Range header."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(
        self,
        repo: str,
        files: dict[str, bytes],
        cut: tuple[str, ...] = (),
        card: dict | None = None,
    ):
        self.repo, self.files, self.cut, self.card = repo, files, set(cut), card
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, name: str) -> list[str | None]:
        """The Range header of each GET of file ``name``."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + name)]

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Range")))
        api = f"/api/datasets/{self.repo}"
        if path == api or path.startswith(f"{api}/revision/"):  # its info (card: its YAML)
            info = {"id": self.repo, "sha": COMMIT, "siblings": []}
            return self.json(h, {**info, "cardData": self.card} if self.card else info, body)
        if path.startswith(f"{api}/tree/"):
            tree = [{"type": "file", "path": p, "size": len(b), "oid": sha1(b)}
                    for p, b in sorted(self.files.items())]  # fmt: skip
            return self.json(h, tree, body)
        prefix = f"/datasets/{self.repo}/resolve/{COMMIT}/"
        name = path[len(prefix) :] if path.startswith(prefix) else None
        if name not in self.files:
            h.send_response(404)
            h.send_header("X-Error-Code", "EntryNotFound")
            h.end_headers()
            return None
        data = self.files[name]
        start = int(h.headers["Range"].split("=")[1].split("-")[0]) if h.headers["Range"] else 0
        h.send_response(206 if start else 200)
        h.send_header("ETag", f'"{sha1(data)}"')
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if not body:
            return None
        if name in self.cut:  # promised all of it, sends half, hangs up
            self.cut.discard(name)
            h.wfile.write(data[start : len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return None
        h.wfile.write(data[start:])
        return None

    @staticmethod
    def json(h: BaseHTTPRequestHandler, value, body: bool) -> None:
        data = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)


def sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()
