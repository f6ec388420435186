"""A stand-in for the Hugging Face Hub's HTTP API, on 127.0.0.1, for the export's --push-to-hub
test: the calls a one-commit upload makes (create the repository, check the model card's
metadata, ask how each file is to be sent, commit), answered as the Hub answers them; every file it is sent is kept,
with the
Authorization header of each request. Point ``HF_ENDPOINT`` at ``url``."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubStub:
    def __init__(self):
        self.files: dict[str, dict[str, bytes]] = {}
        """Committed files: {repo: {path: bytes}}."""
        self.created: list[dict] = []
        self.cards: list[str] = []
        self.private: set[str] = set()
        self.public: set[str] = set()
        """Repositories that exist, public, before the test (a create with exist_ok keeps them public)."""
        self.authorizations: set[str] = set()
        self.unexpected: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, body: dict, status: int = 200):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                stub.authorizations.add(self.headers.get("Authorization", ""))
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts == ["api", "repos", "create"]:
                    request = json.loads(body)
                    stub.created.append(request)
                    repo = f"{request.get('organization')}/{request['name']}"
                    if request.get("visibility") == "private" and repo not in stub.public:
                        stub.private.add(repo)
                    return self._reply({"url": f"{stub.url}/{repo}", "name": repo})
                if parts == ["api", "validate-yaml"]:  # the model card's front matter
                    stub.cards.append(json.loads(body)["content"])
                    return self._reply({"errors": [], "warnings": []})
                if parts[:2] == ["api", "models"] and len(parts) > 4 and parts[4] == "preupload":
                    files = json.loads(body)["files"]
                    return self._reply(
                        {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
                    )
                if parts[:2] == ["api", "models"] and len(parts) > 4 and parts[4] == "commit":
                    repo = f"{parts[2]}/{parts[3]}"
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            value = item["value"]
                            stub.files.setdefault(repo, {})[value["path"]] = base64.b64decode(value["content"])
                    return self._reply(
                        {
                            "commitUrl": f"{stub.url}/{repo}/commit/{'0' * 40}",
                            "commitOid": "0" * 40,
                            "pullRequestUrl": None,
                        }
                    )
                stub.unexpected.append(f"POST {self.path}")
                return self._reply({"error": "not found"}, 404)

            def do_GET(self):
                parts = self.path.split("?")[0].strip("/").split("/")
                repo = "/".join(parts[2:4])
                if parts[:2] == ["api", "models"] and any(
                    c.get("organization") + "/" + c["name"] == repo for c in stub.created
                ):
                    return self._reply({"id": repo, "private": repo in stub.private, "sha": "0" * 40})
                stub.unexpected.append(f"GET {self.path}")
                return self._reply({"error": "not found"}, 404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "HubStub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
