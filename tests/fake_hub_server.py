"""A local stand-in for the Hugging Face Hub, enough for ``create_repo`` + ``upload_folder``.

It answers the endpoints huggingface_hub 2.4 calls when it pushes a folder of small files:

- ``POST /api/repos/create``                        -> the repo URL (409 when it exists, as the Hub)
- ``POST /api/validate-yaml``                       -> no errors (sent when README.md is uploaded)
- ``POST /api/{type}s/{ns}/{name}/preupload/{rev}`` -> every file ``"regular"``: no LFS, no Xet
- ``POST /api/{type}s/{ns}/{name}/commit/{rev}``    -> NDJSON body; base64 ``file`` lines are stored
- ``GET  /api/{type}s/{ns}/{name}[/revision/{rev}]`` -> repo info (asked after an empty commit)
- ``GET  /api/whoami-v2``                           -> a dummy user
- ``GET  /api/agent-harnesses``                     -> 404 (huggingface_hub's user-agent lookup)

The server records what arrives: ``server.files[repo_id][path] = bytes`` and every request as
``(method, path)`` in ``server.requests``; anything else is answered 404 and listed in
``server.unhandled`` so a test can see a call it did not expect.

Use::

    with FakeHubServer() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.endpoint)
        ...
"""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_REPO = r"(?P<type>model|dataset|space)s/(?P<repo>[^/]+/[^/]+)"
_PREUPLOAD = re.compile(rf"^/api/{_REPO}/preupload/(?P<rev>[^/]+)$")
_COMMIT = re.compile(rf"^/api/{_REPO}/commit/(?P<rev>[^/]+)$")
_REPO_INFO = re.compile(rf"^/api/{_REPO}(/revision/(?P<rev>[^/]+))?$")


class FakeHubServer:
    """A threading HTTP server on 127.0.0.1 at a free port; a context manager."""

    def __init__(self) -> None:
        self.files: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, list[str]] = {}  # repo_id -> commit summaries, in order
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        # When set, commits are refused with 403 (not retried by huggingface_hub), to test a
        # push that fails after the repo was created.
        self.reject_commits = False
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeHubServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "FakeHubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- endpoint logic, called from the handler threads -------------------------------------

    def _create_repo(self, body: dict) -> tuple[int, dict]:
        repo_id = f"{body.get('organization') or 'tester'}/{body['name']}"
        with self._lock:
            if repo_id in self.files:
                return 409, {"error": "You already created this model repo", "url": f"{self.endpoint}/{repo_id}"}
            self.files[repo_id] = {}
            self.commits[repo_id] = []
        return 200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id, "id": repo_id}

    def _preupload(self, repo_id: str, body: dict) -> tuple[int, dict]:
        if repo_id not in self.files:
            return 404, {"error": f"Repository {repo_id} not found"}
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in body["files"]]
        return 200, {"files": files, "commitOid": self._head(repo_id)}

    def _commit(self, repo_id: str, raw: bytes) -> tuple[int, dict]:
        if repo_id not in self.files:
            return 404, {"error": f"Repository {repo_id} not found"}
        if self.reject_commits:
            return 403, {"error": "You don't have the rights to create a commit in this repo"}
        summary = ""
        with self._lock:
            for line in raw.splitlines():
                if not line.strip():
                    continue
                item = json.loads(line)
                if item["key"] == "header":
                    summary = item["value"]["summary"]
                elif item["key"] == "file":
                    value = item["value"]
                    if value.get("encoding") != "base64":
                        return 400, {"error": f"unsupported encoding {value.get('encoding')!r}"}
                    self.files[repo_id][value["path"]] = base64.b64decode(value["content"])
                elif item["key"] in ("deletedFile", "deletedFolder"):
                    path = item["value"]["path"]
                    self.files[repo_id] = {
                        p: b for p, b in self.files[repo_id].items() if p != path and not p.startswith(path.rstrip("/") + "/")
                    }
                else:  # lfsFile: this server never asks for LFS, so receiving one is a client bug
                    return 400, {"error": f"unexpected commit operation {item['key']!r}"}
            self.commits[repo_id].append(summary)
        oid = self._head(repo_id)
        return 200, {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}

    def _repo_info(self, repo_id: str) -> tuple[int, dict]:
        if repo_id not in self.files:
            return 404, {"error": f"Repository {repo_id} not found"}
        siblings = [{"rfilename": p} for p in sorted(self.files[repo_id])]
        return 200, {"id": repo_id, "modelId": repo_id, "sha": self._head(repo_id), "private": False, "siblings": siblings}

    def _head(self, repo_id: str) -> str:
        """A fake 40-hex commit id that changes with each commit."""
        return f"{len(self.commits.get(repo_id, [])):040x}"


def _handler_for(server: FakeHubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> None:
            path = unquote(urlsplit(self.path).path)
            raw = self._body() if method == "POST" else b""
            server.requests.append((method, path))
            if method == "POST" and path == "/api/repos/create":
                status, payload = server._create_repo(json.loads(raw))
            elif method == "POST" and path == "/api/validate-yaml":
                status, payload = 200, {"errors": [], "warnings": []}
            elif method == "POST" and (m := _PREUPLOAD.match(path)):
                status, payload = server._preupload(m["repo"], json.loads(raw))
            elif method == "POST" and (m := _COMMIT.match(path)):
                status, payload = server._commit(m["repo"], raw)
            elif method == "GET" and path == "/api/agent-harnesses":
                # huggingface_hub's once-a-day user-agent lookup; a 404 keeps it from caching a
                # registry into the real HF_HOME.
                status, payload = 404, {"error": "not served"}
            elif method == "GET" and path == "/api/whoami-v2":
                status, payload = 200, {"type": "user", "name": "tester", "auth": {"type": "access_token"}}
            elif method == "GET" and (m := _REPO_INFO.match(path)):
                status, payload = server._repo_info(m["repo"])
            else:
                server.unhandled.append((method, path))
                status, payload = 404, {"error": f"fake hub does not serve {method} {path}"}
            self._reply(status, payload)

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

    return Handler
