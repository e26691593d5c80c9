"""A tiny stand-in for the Hugging Face Hub: the few endpoints huggingface_hub
calls to download a model (model info, the file tree, file resolves with
X-Repo-Commit / ETag / X-Linked-Size headers, no Xet), over repos a test
writes. It records the files it served."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, tuple[str, dict[str, bytes]]] = {}  # id -> (commit, files)
        self.served: list[str] = []  # "repo/file" of every GET of a file
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_repo(self, repo_id: str, files: dict[str, bytes]) -> str:
        commit = hashlib.sha1(repo_id.encode()).hexdigest()
        self.repos[repo_id] = (commit, files)
        return commit

    def add_directory(self, repo_id: str, directory: str | Path, **extra: bytes) -> str:
        files = {p.name: p.read_bytes() for p in Path(directory).iterdir() if p.is_file()}
        return self.add_repo(repo_id, {**files, **extra})

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _json(self, body: object, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, code: str) -> None:
            data = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _repo(self, repo_id: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
            if repo_id not in hub.repos:
                self._error(404, "RepoNotFound")
                return None
            commit, files = hub.repos[repo_id]
            if revision not in ("main", commit):
                self._error(404, "RevisionNotFound")
                return None
            return commit, files

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) >= 6:
                repo_id, kind, revision = "/".join(parts[2:4]), parts[4], parts[5]
                found = self._repo(repo_id, revision)
                if found is None:
                    return
                commit, files = found
                if kind == "revision":
                    return self._json({"id": repo_id, "modelId": repo_id, "sha": commit,
                                       "private": False, "tags": [], "downloads": 0,
                                       "likes": 0,
                                       "siblings": [{"rfilename": f} for f in files]})
                if kind == "tree":
                    return self._json([_entry(name, data) for name, data in files.items()])
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                found = self._repo(repo_id, revision)
                if found is None:
                    return
                commit, files = found
                if name not in files:
                    return self._error(404, "EntryNotFound")
                data = files[name]
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                if name.endswith(LFS_SUFFIXES):
                    self.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("ETag", f'"{_blob_id(data)}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    hub.served.append(f"{repo_id}/{name}")
                    self.wfile.write(data)
                return
            self._error(404, "NotFound")

    return Handler


def _entry(name: str, data: bytes) -> dict:
    entry = {"type": "file", "path": name, "size": len(data), "oid": _blob_id(data)}
    if name.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                        "pointerSize": 134}
    return entry
