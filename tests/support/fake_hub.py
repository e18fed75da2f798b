"""A local stand-in for the Hugging Face hub's HTTP API, so the hub-id paths (``moejax.models.hub``) are
tested with real ``huggingface_hub`` downloads of local files (this machine has no hub access).

It answers what ``snapshot_download`` asks, as the hub does: ``/api/models/{repo}/revision/{rev}`` (the
commit), ``/api/models/{repo}/tree/{commit}`` (the files and their sizes) and ``/{repo}/resolve/{rev}/{path}``
(a file, with the ``X-Repo-Commit`` and ``ETag`` headers); an unknown repository is 404 ``RepoNotFound``, a
gated one 401 ``GatedRepo``. ``cut`` makes a file's download stop after that many bytes (a dropped
connection), ``stall`` makes it send that many bytes and then wait (a slow download, to interrupt); ``requests`` records every (method, path) asked, so a test can check what was fetched.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import urllib.parse


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]], gated=(), cut: dict[str, int] | None = None,
                 stall: dict[str, int] | None = None):
        self.repos, self.gated, self.cut, self.stall = repos, set(gated), dict(cut or {}), dict(stall or {})
        self.closing = threading.Event()
        self.requests: list[tuple[str, str]] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def commit(self, repo: str) -> str:
        files = sorted((name, hashlib.sha1(data).hexdigest()) for name, data in self.repos[repo].items())
        return hashlib.sha1(json.dumps(files).encode()).hexdigest()

    def fetched(self) -> set[str]:
        """The files whose contents were downloaded (GET of a resolve URL)."""
        return {path.split("/resolve/", 1)[1].split("/", 1)[1] for method, path in self.requests
                if method == "GET" and "/resolve/" in path}

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


def _handler(hub: FakeHub):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self._answer(body=False)

        def do_GET(self):
            self._answer(body=True)

        def _send(self, code, data=b"", headers=(), body=True, length=None):
            self.send_response(code)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data) if length is None else length))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _answer(self, body: bool):
            path = urllib.parse.urlparse(self.path).path
            hub.requests.append((self.command, path))
            api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(/.*)?", path)
            resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            repo = (api or resolve).group(1) if (api or resolve) else None
            if repo not in hub.repos:
                return self._send(404, b'{"error": "Repository not found"}', [("X-Error-Code", "RepoNotFound")], body)
            if repo in hub.gated:
                return self._send(401, b'{"error": "gated"}', [("X-Error-Code", "GatedRepo"),
                                                                ("X-Error-Message", "Access is restricted")], body)
            files = hub.repos[repo]
            if api and api.group(2) == "revision":
                if urllib.parse.unquote(api.group(3)) not in ("main", hub.commit(repo)):
                    return self._send(404, b'{"error": "Invalid rev id"}', [("X-Error-Code", "RevisionNotFound")], body)
                data = {"id": repo, "sha": hub.commit(repo), "private": False,
                        "siblings": [{"rfilename": name} for name in files]}
                return self._send(200, json.dumps(data).encode(), [("Content-Type", "application/json")], body)
            if api:
                data = [{"type": "file", "oid": hashlib.sha1(v).hexdigest(), "size": len(v), "path": name}
                        for name, v in files.items()]
                return self._send(200, json.dumps(data).encode(), [("Content-Type", "application/json")], body)
            name = resolve.group(3)
            if name not in files:
                return self._send(404, b"", [("X-Error-Code", "EntryNotFound")], body)
            data = files[name]
            headers = [("X-Repo-Commit", hub.commit(repo)), ("ETag", '"%s"' % hashlib.sha256(data).hexdigest())]
            if body and name in hub.cut:  # announce the whole file, send part of it, hang up
                self._send(200, data[:hub.cut[name]], headers, True, length=len(data))
                self.close_connection = True
                return
            if body and name in hub.stall:  # announce the whole file, send part of it, wait
                self._send(200, data[:hub.stall[name]], headers, True, length=len(data))
                self.wfile.flush()
                hub.closing.wait(120)
                self.close_connection = True
                return
            return self._send(200, data, headers, body)

    return Handler
