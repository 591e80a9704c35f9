"""A local HTTP server speaking the subset of the Hugging Face Hub's API that ``huggingface_hub``
uses to pull and push: repo info with the file list and sizes, ``resolve`` (HEAD and ranged GETs,
ETags, the commit header), gated (401/403) and private repos, unknown repos and revisions (404),
repo creation, preupload and NDJSON commits. It never advertises Xet, so the client takes the
plain HTTP path. Every byte it serves is counted per file, and downloads can be slowed down."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

CHUNK = 64 * 1024


@dataclass
class Repo:
    files: dict[str, bytes]
    kind: str = "model"  # model | dataset
    gated: bool = False
    private: bool = False
    revisions: dict[str, dict[str, bytes]] = field(default_factory=dict)  # another revision's files

    def sha(self, revision: str) -> str:
        """A commit id: a digest of the revision's files (a push makes a new one)."""
        files = self.files if revision == "main" else self.revisions[revision]
        digest = hashlib.sha1(revision.encode())
        for path in sorted(files):
            digest.update(path.encode() + hashlib.sha256(files[path]).digest())
        return digest.hexdigest()


class FakeHub:
    """``start()`` it, point ``HF_ENDPOINT`` (``ROUNDHOUSE_HUB_ENDPOINT``) at ``url``."""

    def __init__(self, *, token: str = "hf_test_token") -> None:
        self.token = token
        self.repos: dict[tuple[str, str], Repo] = {}
        self.served: Counter[str] = Counter()  # "repo/path" -> bytes sent
        self.bytes_per_s: float | None = None  # slow every download down to this rate
        self.pushed: dict[str, list[str]] = {}  # repo -> files committed, in order
        self.created: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeHub:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo_id: str, files: dict[str, bytes], **options: Any) -> Repo:
        repo = Repo(dict(files), **options)
        self.repos[(repo.kind, repo_id)] = repo
        return repo

    def add_folder(self, repo_id: str, folder: Path, **options: Any) -> Repo:
        files = {
            p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
        }
        return self.add(repo_id, files, **options)

    def served_bytes(self, repo_id: str) -> int:
        return sum(n for key, n in self.served.items() if key.startswith(repo_id + "/"))

    # -- the handler ------------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, status: int, data: Any, code: str | None = None) -> None:
                headers = {"Content-Type": "application/json"}
                if code:
                    headers["X-Error-Code"] = code
                self._send(status, json.dumps(data).encode(), headers)

            def _authorized(self) -> bool:
                return self.headers.get("Authorization", "") == f"Bearer {hub.token}"

            def _repo(self, kind: str, repo_id: str) -> Repo | None:
                repo = hub.repos.get((kind, repo_id))
                if repo is None:
                    self._json(404, {"error": "Repository not found"}, "RepoNotFound")
                    return None
                if repo.private and not self._authorized():
                    self._json(401, {"error": "Invalid username or password."}, "RepoNotFound")
                    return None
                return repo

            def _files(self, repo: Repo, revision: str) -> tuple[dict[str, bytes], str] | None:
                if revision in ("main", repo.sha("main")):
                    return repo.files, repo.sha("main")
                for name, files in repo.revisions.items():
                    if revision in (name, repo.sha(name)):
                        return files, repo.sha(name)
                self._json(404, {"error": f"Invalid rev id: {revision}"}, "RevisionNotFound")
                return None

            def _split(self) -> list[str]:
                return [unquote(p) for p in urlsplit(self.path).path.split("/")[1:]]

            def do_HEAD(self) -> None:
                self._resolve()

            def do_GET(self) -> None:
                parts = self._split()
                if parts[:1] == ["api"] and len(parts) >= 4 and parts[1] in ("models", "datasets"):
                    return self._info(parts)
                self._resolve()

            def _info(self, parts: list[str]) -> None:
                kind = parts[1][:-1]
                repo_id = "/".join(parts[2:4])
                revision = "main"
                if len(parts) >= 6 and parts[4] == "revision":
                    revision = "/".join(parts[5:])
                repo = self._repo(kind, repo_id)
                if repo is None:
                    return
                found = self._files(repo, revision)
                if found is None:
                    return
                files, sha = found
                siblings = [
                    {"rfilename": p, "size": len(b), "blobId": hashlib.sha1(b).hexdigest()}
                    for p, b in sorted(files.items())
                ]
                self._json(
                    200,
                    {
                        "id": repo_id,
                        "sha": sha,
                        "private": repo.private,
                        "gated": "manual" if repo.gated else False,
                        "siblings": siblings,
                    },
                )

            def _resolve(self) -> None:
                parts = self._split()
                kind = "model"
                if parts[:1] == ["datasets"]:
                    kind, parts = "dataset", parts[1:]
                if len(parts) < 5 or parts[2] != "resolve":
                    return self._json(404, {"error": "not found"})
                repo_id = "/".join(parts[:2])
                repo = self._repo(kind, repo_id)
                if repo is None:
                    return
                # a revision may hold slashes (refs/convert/parquet): the longest one that exists
                rest = parts[3:]
                revision, path = rest[0], "/".join(rest[1:])
                for cut in range(len(rest) - 1, 0, -1):
                    candidate = "/".join(rest[:cut])
                    known = {"main", repo.sha("main"), *repo.revisions, *map(repo.sha, repo.revisions)}
                    if candidate in known:
                        revision, path = candidate, "/".join(rest[cut:])
                        break
                found = self._files(repo, revision)
                if found is None:
                    return
                files, sha = found
                if repo.gated and not self._authorized():
                    status = 403 if self.headers.get("Authorization") else 401
                    return self._json(status, {"error": "Access to this model is restricted."}, "GatedRepo")
                if path not in files:
                    return self._json(404, {"error": "Entry not found"}, "EntryNotFound")
                data = files[path]
                etag = (
                    hashlib.sha256(data).hexdigest() if len(data) > 10_000 else hashlib.sha1(data).hexdigest()
                )
                headers = {"ETag": f'"{etag}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
                start = 0
                wanted = self.headers.get("Range")
                if wanted and self.command == "GET":
                    start = int(wanted.split("=")[1].split("-")[0])
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                if self.command == "HEAD":
                    self.send_response(200)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    return
                body = data[start:]
                self.send_response(206 if start else 200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                key = f"{repo_id}/{path}"
                for i in range(0, len(body), CHUNK):
                    piece = body[i : i + CHUNK]
                    try:
                        self.wfile.write(piece)
                        self.wfile.flush()
                    except OSError:
                        return
                    with hub.lock:
                        hub.served[key] += len(piece)
                    if hub.bytes_per_s:
                        time.sleep(len(piece) / hub.bytes_per_s)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_POST(self) -> None:
                parts = self._split()
                body = self._body()
                if parts[:3] == ["api", "repos", "create"]:
                    if not self._authorized():
                        return self._json(401, {"error": "Invalid credentials"})
                    request = json.loads(body)
                    repo_id = f"{request['organization']}/{request['name']}"
                    hub.created.append(request)
                    url = f"{hub.url}/{repo_id}"
                    if ("model", repo_id) in hub.repos:
                        return self._json(409, {"error": "You already created this model repo", "url": url})
                    hub.add(
                        repo_id,
                        {},
                        private=request.get("visibility") == "private" or bool(request.get("private")),
                    )
                    return self._json(200, {"url": url, "name": repo_id})
                if parts[:2] == ["api", "validate-yaml"]:
                    return self._json(200, {"errors": [], "warnings": []})
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("preupload", "commit"):
                    if not self._authorized():
                        return self._json(401, {"error": "Invalid credentials"})
                    repo_id = "/".join(parts[2:4])
                    repo = hub.repos.get(("model", repo_id))
                    if repo is None:
                        return self._json(404, {"error": "Repository not found"}, "RepoNotFound")
                    if parts[4] == "preupload":
                        files = json.loads(body)["files"]
                        modes = [
                            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                            for f in files
                        ]
                        return self._json(200, {"files": modes})
                    committed = []
                    for line in body.splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            value = item["value"]
                            repo.files[value["path"]] = base64.b64decode(value["content"])
                            committed.append(value["path"])
                    hub.pushed.setdefault(repo_id, []).extend(committed)
                    sha = repo.sha("main")
                    return self._json(
                        200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{sha}", "commitOid": sha}
                    )
                self._json(404, {"error": "not found"})

        return Handler
