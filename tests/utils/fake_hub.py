"""A local HTTP server speaking the subset of the Hugging Face Hub's API that ``huggingface_hub``
uses to pull and push: repo info with the file list and sizes, ``resolve`` (HEAD and ranged GETs,
ETags, the commit header), gated (401/403) and private repos, unknown repos and revisions (404),
repo creation (a read-only token is refused with 403), preupload (binary files go by LFS, as on the
Hub), the LFS batch API with its PUT upload and verify, and NDJSON commits. It never advertises Xet,
so the client takes the plain HTTP path (a push needs ``HF_HUB_DISABLE_XET``: ``hub_xet=False``).
Every byte it serves or receives is counted per file, and downloads can be slowed down."""

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
        self.token_writes = True  # False: the token reads, and is refused (403) when it writes
        self.repos: dict[tuple[str, str], Repo] = {}
        self.served: Counter[str] = Counter()  # "repo/path" -> bytes sent
        self.bytes_per_s: float | None = None  # slow every download down to this rate
        self.pushed: dict[str, list[str]] = {}  # repo -> files committed, in order
        self.lfs: dict[str, bytes] = {}  # sha256 -> an object uploaded by LFS
        self.received: Counter[str] = Counter()  # "lfs" (PUT bodies) and "regular" (in commits) bytes
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

            def _may_write(self) -> bool:
                """Writes need the token (else a 401) with write access (else a 403)."""
                if not self._authorized():
                    self._json(401, {"error": "Invalid credentials in Authorization header"})
                    return False
                if not hub.token_writes:
                    self._json(403, {"error": "You don't have the rights to write to this namespace"})
                    return False
                return True

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
                if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                    return self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = b""  # an upload streamed from a file: chunked
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    body += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return body

            def do_PUT(self) -> None:
                parts = self._split()
                body = self._body()
                if parts[:1] != ["lfs-upload"] or len(parts) != 2:
                    return self._json(404, {"error": "not found"})
                if hashlib.sha256(body).hexdigest() != parts[1]:
                    return self._json(400, {"error": "the body does not match its oid"})
                with hub.lock:
                    hub.lfs[parts[1]] = body
                    hub.received["lfs"] += len(body)
                self._send(200)

            def do_POST(self) -> None:
                parts = self._split()
                body = self._body()
                if parts[:3] == ["api", "repos", "create"]:
                    return self._create(json.loads(body))
                if parts[:2] == ["api", "validate-yaml"]:
                    return self._json(200, {"errors": [], "warnings": []})
                if (
                    len(parts) == 6
                    and parts[1].endswith(".git")
                    and parts[2:] == ["info", "lfs", "objects", "batch"]
                ):
                    return self._batch(f"{parts[0]}/{parts[1][:-4]}", json.loads(body))
                if parts[:1] == ["lfs-verify"]:
                    found = hub.lfs.get(json.loads(body)["oid"])
                    return self._json(200 if found is not None else 404, {})
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("preupload", "commit"):
                    repo_id = "/".join(parts[2:4])
                    repo = hub.repos.get(("model", repo_id))
                    if repo is None:
                        return self._json(404, {"error": "Repository not found"}, "RepoNotFound")
                    if not self._may_write():
                        return None
                    if parts[4] == "preupload":
                        return self._preupload(json.loads(body)["files"])
                    return self._commit(repo_id, repo, body)
                self._json(404, {"error": "not found"})

            def _create(self, request: dict[str, Any]) -> None:
                if not self._may_write():
                    return
                repo_id = f"{request['organization']}/{request['name']}"
                hub.created.append(request)
                url = f"{hub.url}/{repo_id}"
                if ("model", repo_id) in hub.repos:
                    return self._json(409, {"error": "You already created this model repo", "url": url})
                hub.add(repo_id, {}, private=request.get("visibility") == "private")
                self._json(200, {"url": url, "name": repo_id})

            def _preupload(self, files: list[dict[str, Any]]) -> None:
                """Binary files (a NUL in the sample) go by LFS, text files in the commit: as the
                Hub's default ``.gitattributes`` does for weights."""
                modes = []
                for f in files:
                    binary = b"\0" in base64.b64decode(f["sample"]) or f["size"] > 10 << 20
                    mode = "lfs" if binary else "regular"
                    modes.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": None})
                self._json(200, {"files": modes})

            def _batch(self, repo_id: str, request: dict[str, Any]) -> None:
                if ("model", repo_id) not in hub.repos:
                    return self._json(404, {"error": "Repository not found"}, "RepoNotFound")
                if not self._may_write():
                    return
                objects = []
                for o in request["objects"]:
                    entry: dict[str, Any] = {"oid": o["oid"], "size": o["size"]}
                    if o["oid"] not in hub.lfs:
                        entry["actions"] = {
                            "upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"},
                            "verify": {"href": f"{hub.url}/lfs-verify/{o['oid']}"},
                        }
                    objects.append(entry)
                self._json(200, {"transfer": "basic", "objects": objects})

            def _commit(self, repo_id: str, repo: Repo, body: bytes) -> None:
                committed, changes = [], {}
                for line in body.splitlines():
                    item = json.loads(line)
                    value = item["value"]
                    if item["key"] == "file":
                        changes[value["path"]] = base64.b64decode(value["content"])
                        hub.received["regular"] += len(changes[value["path"]])
                    elif item["key"] == "lfsFile":
                        if value["oid"] not in hub.lfs:
                            return self._json(400, {"error": f"LFS object {value['oid']} was never uploaded"})
                        changes[value["path"]] = hub.lfs[value["oid"]]
                    else:
                        continue
                    committed.append(value["path"])
                repo.files.update(changes)
                hub.pushed.setdefault(repo_id, []).extend(committed)
                sha = repo.sha("main")
                self._json(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{sha}", "commitOid": sha})

        return Handler
