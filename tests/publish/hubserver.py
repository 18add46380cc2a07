"""A fake Hugging Face Hub on loopback, for tests: the routes huggingface_hub's upload, listing and
download calls use, with repos in memory and every request recorded.

Routes (huggingface_hub 1.x): GET /api/whoami-v2; POST /api/repos/create; POST /api/validate-yaml;
GET /api/models/{repo}[/revision/{rev}] (repo info); GET /api/models/{repo}/tree/{rev}[/{path}];
POST /api/models/{repo}/paths-info/{rev}; POST /api/models/{repo}/preupload/{rev};
POST /api/models/{repo}/commit/{rev} (NDJSON: header, file, lfsFile, deletedFile, deletedFolder);
POST /api/models/{repo}/branch/{branch}; POST /{repo}.git/info/lfs/objects/batch;
PUT /lfs-storage/{repo}/{oid}?sig= (the "presigned" upload URL the batch hands out; no token);
POST /{repo}.git/info/lfs/objects/verify; HEAD and GET /{repo}/resolve/{rev}/{path} (Range too).

Like the hub: a new repo holds one commit with .gitattributes; a file goes through LFS when its
name matches an LFS pattern, it is 10 MiB or more, or its first bytes hold a NUL; tree entries of
LFS files carry {oid: sha256, size, pointerSize} and a git oid of their pointer file; errors carry
X-Error-Code / X-Error-Message. Not a hub: model repos only, no pull requests, no Xet (tests turn
hf_xet off: `point_huggingface_hub_at`), no pagination, one user with write access to its own
namespace and its orgs.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import itertools
import json
import re
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LFS_PATTERNS = ("*.safetensors", "*.onnx", "*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.zip", "*.tar.gz", "*.whl")
LFS_MIN_SIZE = 10 << 20
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()
WRITE_METHODS = frozenset({"POST", "PUT", "DELETE", "PATCH"})


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class Blob:
    """A file of a commit. The hashes are fixed when it is stored; `corrupt` changes only `data`."""

    data: bytes
    lfs: bool
    sha256: str = ""
    oid: str = ""  # the git object id: of the content, or of the LFS pointer

    def __post_init__(self) -> None:
        self.sha256 = hashlib.sha256(self.data).hexdigest()
        self.oid = git_oid(lfs_pointer(self.sha256, len(self.data)) if self.lfs else self.data)

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Commit:
    oid: str
    parent: str | None
    title: str
    files: dict[str, Blob]


@dataclass
class Repo:
    repo_id: str
    private: bool
    created: str
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes uploaded (committed or not)

    def resolve(self, revision: str) -> Commit | None:
        oid = self.branches.get(revision, revision)
        return self.commits.get(oid)


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # with the query string
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


class HubFailure(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class FakeHub:
    """`with FakeHub(token) as hub:` serves on http://127.0.0.1:<port> (`hub.url`) until the block ends."""

    def __init__(self, token: str, user: str = "tester", orgs: tuple[str, ...] = ("org",)) -> None:
        self.token, self.user, self.orgs = token, user, orgs
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self._failures: dict[str, list[tuple[int, str]]] = {}
        self._signatures: set[str] = set()
        self._lock = threading.RLock()
        self._counter = itertools.count()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.hub = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # --- for tests ------------------------------------------------------------------------------
    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """path -> bytes as the hub serves them at `revision`."""
        with self._lock:
            commit = self.repos[repo_id].resolve(revision)
            return {path: blob.data for path, blob in commit.files.items()}

    def lfs_paths(self, repo_id: str, revision: str = "main") -> set[str]:
        with self._lock:
            return {p for p, b in self.repos[repo_id].resolve(revision).files.items() if b.lfs}

    def head(self, repo_id: str, revision: str = "main") -> str:
        with self._lock:
            return self.repos[repo_id].branches[revision]

    def create_repo(self, repo_id: str, private: bool = False) -> None:
        """A repo created on the hub's side (in the web UI): one commit, with .gitattributes."""
        with self._lock:
            self._create_repo(repo_id, private)

    def server_commit(
        self, repo_id: str, title: str, add: dict[str, bytes] | None = None, delete: tuple[str, ...] = ()
    ) -> str:
        """A commit to main made on the hub's side (someone else's push, a deletion in the web UI)."""
        with self._lock:
            repo = self.repos[repo_id]
            files = dict(repo.resolve("main").files)
            for path in delete:
                del files[path]
            for path, data in (add or {}).items():
                files[path] = Blob(data, _is_lfs(path, len(data), data[:512]))
                if files[path].lfs:
                    repo.lfs[files[path].sha256] = data
            return self._commit(repo, "main", title, files)

    def corrupt(self, repo_id: str, path: str, revision: str = "main") -> None:
        """Flip one byte of a stored file; its recorded hashes (tree, ETag) stay as they were."""
        with self._lock:
            blob = self.repos[repo_id].resolve(revision).files[path]
            at = secrets.randbelow(blob.size)
            blob.data = blob.data[:at] + bytes([blob.data[at] ^ 0xFF]) + blob.data[at + 1 :]

    def fail_next(self, route: str, status: int = 500, message: str = "injected failure") -> None:
        """The next request to `route` (a handler name: commit, lfs_upload, resolve ...) fails."""
        with self._lock:
            self._failures.setdefault(route, []).append((status, message))

    def mark(self) -> int:
        """The number of requests so far: `hub.requests[mark:]` are the ones after this call."""
        with self._lock:
            return len(self.requests)

    def token_leaks(self) -> list[str]:
        """Every place a recorded request carries the token other than `Authorization: Bearer <token>`."""
        leaks = []
        for r in self.requests:
            if self.token in r.path:
                leaks.append(f"{r.method} {r.path}: in the URL")
            if self.token.encode() in r.body:
                leaks.append(f"{r.method} {r.path}: in the body")
            for name, value in r.headers:
                if self.token in value and not (name.lower() == "authorization" and value == f"Bearer {self.token}"):
                    leaks.append(f"{r.method} {r.path}: in header {name}")
        return leaks

    # --- state changes (under the lock) -----------------------------------------------------------
    def _commit(self, repo: Repo, branch: str, title: str, files: dict[str, Blob]) -> str:
        parent = repo.branches.get(branch)
        seed = f"{repo.repo_id}\0{parent}\0{title}\0{next(self._counter)}\0" + "".join(
            f"{p}\0{b.oid}\0" for p, b in sorted(files.items())
        )
        oid = hashlib.sha1(seed.encode()).hexdigest()
        repo.commits[oid] = Commit(oid, parent, title, files)
        repo.branches[branch] = oid
        return oid

    def _create_repo(self, repo_id: str, private: bool) -> Repo:
        repo = Repo(repo_id, private, _now())
        self._commit(repo, "main", "initial commit", {".gitattributes": Blob(GITATTRIBUTES, lfs=False)})
        self.repos[repo_id] = repo
        return repo

    def _take_failure(self, route: str) -> tuple[int, str] | None:
        with self._lock:
            queue = self._failures.get(route)
            return queue.pop(0) if queue else None

    def _sign(self) -> str:
        signature = secrets.token_hex(16)
        self._signatures.add(signature)
        return signature


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _is_lfs(path: str, size: int, sample: bytes) -> bool:
    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(name, p) for p in LFS_PATTERNS) or size >= LFS_MIN_SIZE or b"\0" in sample


# --- HTTP ----------------------------------------------------------------------------------------
_REPO = r"(?P<repo>[^/]+/[^/]+)"
_REV = r"(?P<rev>[^/]+)"
_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(r"/api/whoami-v2"), "whoami"),
    ("POST", re.compile(r"/api/repos/create"), "create_repo"),
    ("POST", re.compile(r"/api/validate-yaml"), "validate_yaml"),
    ("GET", re.compile(rf"/api/models/{_REPO}(?:/revision/{_REV})?"), "repo_info"),
    ("GET", re.compile(rf"/api/models/{_REPO}/tree/{_REV}(?:/(?P<path>.+))?"), "tree"),
    ("POST", re.compile(rf"/api/models/{_REPO}/paths-info/{_REV}"), "paths_info"),
    ("POST", re.compile(rf"/api/models/{_REPO}/preupload/{_REV}"), "preupload"),
    ("POST", re.compile(rf"/api/models/{_REPO}/commit/{_REV}"), "commit"),
    ("POST", re.compile(rf"/api/models/{_REPO}/branch/{_REV}"), "create_branch"),
    ("POST", re.compile(rf"/{_REPO}\.git/info/lfs/objects/batch"), "lfs_batch"),
    ("POST", re.compile(rf"/{_REPO}\.git/info/lfs/objects/verify"), "lfs_verify"),
    ("PUT", re.compile(rf"/lfs-storage/{_REPO}/(?P<oid>[0-9a-f]{{64}})"), "lfs_upload"),
    ("HEAD", re.compile(rf"/{_REPO}/resolve/{_REV}/(?P<path>.+)"), "resolve"),
    ("GET", re.compile(rf"/{_REPO}/resolve/{_REV}/(?P<path>.+)"), "resolve"),
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the hub records requests instead
        pass

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    # --- plumbing -------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        hub: FakeHub = self.server.hub  # type: ignore[attr-defined]
        self.body = self._read_body()
        split = urlsplit(self.path)
        self.query = parse_qs(split.query)
        with hub._lock:
            hub.requests.append(Request(self.command, self.path, tuple(self.headers.items()), self.body))
        for method, pattern, name in _ROUTES:
            match = pattern.fullmatch(split.path) if method == self.command else None
            if match:
                params = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                try:
                    if failure := hub._take_failure(name):
                        raise HubFailure(*failure)
                    with hub._lock:
                        getattr(self, f"_{name}")(hub, params)
                except HubFailure as exc:
                    self._error(exc)
                return
        self._error(HubFailure(404, f"no route for {self.command} {split.path}"))

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline().strip():  # trailers, then the blank line
                pass
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(
        self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, *, length: int | None = None
    ):
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, value: Any, status: int = 200, content_type: str = "application/json", **headers: str) -> None:
        self._send(status, json.dumps(value).encode(), {"Content-Type": content_type, **headers})

    def _error(self, exc: HubFailure) -> None:
        headers = {"X-Error-Message": exc.message, **exc.headers}
        if exc.code:
            headers["X-Error-Code"] = exc.code
        self._json({"error": exc.message}, exc.status, **headers)

    def _user(self, hub: FakeHub) -> str | None:
        auth = self.headers.get("Authorization")
        if auth is None:
            return None
        if auth != f"Bearer {hub.token}":
            raise HubFailure(401, "Invalid credentials in Authorization header")
        return hub.user

    def _repo(self, hub: FakeHub, repo_id: str, *, write: bool = False) -> Repo:
        user = self._user(hub)
        repo = hub.repos.get(repo_id)
        if repo is None or repo.private and user is None:
            raise HubFailure(404, "Repository not found", "RepoNotFound")
        if write:
            self._check_namespace(hub, user, repo_id)
        return repo

    def _check_namespace(self, hub: FakeHub, user: str | None, repo_id: str) -> None:
        if user is None:
            raise HubFailure(401, "You must be authenticated to write")
        if repo_id.split("/")[0] not in (hub.user, *hub.orgs):
            raise HubFailure(403, f"You don't have the rights to write to {repo_id}")

    def _commit_of(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubFailure(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    # --- routes ---------------------------------------------------------------------------------
    def _whoami(self, hub: FakeHub, params: dict[str, str]) -> None:
        if self._user(hub) is None:
            raise HubFailure(401, "Invalid credentials in Authorization header")
        self._json(
            {
                "type": "user",
                "name": hub.user,
                "orgs": [{"type": "org", "name": org} for org in hub.orgs],
                "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": "write"}},
            }
        )

    def _create_repo(self, hub: FakeHub, params: dict[str, str]) -> None:
        payload = json.loads(self.body)
        user = self._user(hub)
        if payload.get("type", "model") not in (None, "model"):
            raise HubFailure(400, "this fake hub holds model repos only")
        repo_id = f"{payload.get('organization') or user}/{payload['name']}"
        self._check_namespace(hub, user, repo_id)
        url = f"{hub.url}/{repo_id}"
        if repo_id in hub.repos:
            raise HubFailure(409, "You already created this model repo", headers={"X-Repo-Url": url})
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        hub._create_repo(repo_id, private)
        self._json({"url": url, "name": repo_id, "id": secrets.token_hex(12)})

    def _validate_yaml(self, hub: FakeHub, params: dict[str, str]) -> None:
        self._json({"errors": [], "warnings": []})

    def _repo_info(self, hub: FakeHub, params: dict[str, str]) -> None:
        repo = self._repo(hub, params["repo"])
        commit = self._commit_of(repo, params.get("rev", "main"))
        self._json(
            {
                "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "author": repo.repo_id.split("/")[0],
                "sha": commit.oid,
                "lastModified": _now(),
                "createdAt": repo.created,
                "private": repo.private,
                "disabled": False,
                "gated": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": [{"rfilename": path} for path in sorted(commit.files)],
            }
        )

    def _tree(self, hub: FakeHub, params: dict[str, str]) -> None:
        commit = self._commit_of(self._repo(hub, params["repo"]), params["rev"])
        recursive = self.query.get("recursive", ["false"])[0].lower() == "true"
        base = params.get("path", "").strip("/")
        entries = _entries(commit, base, recursive)
        if base and not entries and base not in commit.files:
            raise HubFailure(404, f"{base} does not exist", "EntryNotFound")
        self._json(entries)

    def _paths_info(self, hub: FakeHub, params: dict[str, str]) -> None:
        commit = self._commit_of(self._repo(hub, params["repo"]), params["rev"])
        wanted = parse_qs(self.body.decode()).get("paths", [])
        folders = _folders(commit)
        found = [_file_entry(p, commit.files[p]) for p in wanted if p in commit.files]
        found += [_folder_entry(p) for p in wanted if p in folders]
        self._json(found)

    def _preupload(self, hub: FakeHub, params: dict[str, str]) -> None:
        repo = self._repo(hub, params["repo"], write=True)
        commit = self._commit_of(repo, params["rev"])
        answers = []
        for item in json.loads(self.body)["files"]:
            sample = base64.b64decode(item["sample"])
            mode = "lfs" if _is_lfs(item["path"], item["size"], sample) else "regular"
            existing = commit.files.get(item["path"])
            oid = None if existing is None else existing.sha256 if existing.lfs else existing.oid
            answers.append({"path": item["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._json({"files": answers, "commitOid": commit.oid})

    def _commit(self, hub: FakeHub, params: dict[str, str]) -> None:
        repo = self._repo(hub, params["repo"], write=True)
        branch = params["rev"]
        if branch not in repo.branches:
            raise HubFailure(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        if self.query.get("create_pr"):
            raise HubFailure(400, "this fake hub has no pull requests")
        files = dict(repo.resolve(branch).files)
        title = "commit"
        for line in self.body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                title = value["summary"]
                parent = value.get("parentCommit")
                if parent is not None and parent != repo.branches[branch]:
                    raise HubFailure(412, "A commit has happened since. Please refresh and try again.")
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise HubFailure(400, f"unsupported encoding {value.get('encoding')!r}")
                files[value["path"]] = Blob(base64.b64decode(value["content"]), lfs=False)
            elif key == "lfsFile":
                data = repo.lfs.get(value["oid"])
                if data is None or ("size" in value and value["size"] != len(data)):
                    raise HubFailure(422, f"LFS object {value['oid']} of {value['path']} was never uploaded")
                files[value["path"]] = Blob(data, lfs=True)
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise HubFailure(404, f"A file with this name doesn't exist: {value['path']}", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: b for p, b in files.items() if not p.startswith(prefix)}
            else:
                raise HubFailure(400, f"unknown commit operation {key!r}")
        oid = hub._commit(repo, branch, title, files)
        self._json({"success": True, "commitOid": oid, "commitUrl": f"{hub.url}/{repo.repo_id}/commit/{oid}"})

    def _create_branch(self, hub: FakeHub, params: dict[str, str]) -> None:
        repo = self._repo(hub, params["repo"], write=True)
        branch = params["rev"]
        if branch in repo.branches:
            raise HubFailure(409, f"Reference already exists: refs/heads/{branch}")
        start = (json.loads(self.body) if self.body else {}).get("startingPoint") or "main"
        repo.branches[branch] = self._commit_of(repo, start).oid
        self._json({})

    def _lfs_batch(self, hub: FakeHub, params: dict[str, str]) -> None:
        repo = self._repo(hub, params["repo"], write=True)
        payload = json.loads(self.body)
        if payload.get("operation") != "upload":
            raise HubFailure(400, "this fake hub serves LFS uploads only")
        objects = []
        for obj in payload["objects"]:
            oid, size = obj["oid"], obj["size"]
            if repo.lfs.get(oid) is not None and len(repo.lfs[oid]) == size:
                objects.append({"oid": oid, "size": size})  # already there: no actions
                continue
            href = f"{hub.url}/lfs-storage/{repo.repo_id}/{oid}?sig={hub._sign()}"
            verify = f"{hub.url}/{repo.repo_id}.git/info/lfs/objects/verify"
            objects.append(
                {
                    "oid": oid,
                    "size": size,
                    "authenticated": True,
                    "actions": {"upload": {"href": href}, "verify": {"href": verify}},
                }
            )
        self._json(
            {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
            content_type="application/vnd.git-lfs+json",
        )

    def _lfs_upload(self, hub: FakeHub, params: dict[str, str]) -> None:
        signature = self.query.get("sig", [""])[0]
        if signature not in hub._signatures:
            raise HubFailure(403, "bad signature")
        if hashlib.sha256(self.body).hexdigest() != params["oid"]:
            raise HubFailure(400, "the uploaded bytes do not match the object id")
        hub._signatures.discard(signature)
        hub.repos[params["repo"]].lfs[params["oid"]] = self.body
        self._send(200, headers={"ETag": f'"{hashlib.md5(self.body).hexdigest()}"'})

    def _lfs_verify(self, hub: FakeHub, params: dict[str, str]) -> None:
        repo = self._repo(hub, params["repo"], write=True)
        obj = json.loads(self.body)
        data = repo.lfs.get(obj["oid"])
        if data is None or len(data) != obj["size"]:
            raise HubFailure(404, f"LFS object {obj['oid']} not found")
        self._json({}, content_type="application/vnd.git-lfs+json")

    def _resolve(self, hub: FakeHub, params: dict[str, str]) -> None:
        commit = self._commit_of(self._repo(hub, params["repo"]), params["rev"])
        blob = commit.files.get(params["path"])
        if blob is None:
            raise HubFailure(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        headers = {"X-Repo-Commit": commit.oid, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if blob.lfs:
            headers |= {
                "ETag": f'"{blob.sha256}"',
                "X-Linked-Etag": f'"{blob.sha256}"',
                "X-Linked-Size": str(blob.size),
            }
        else:
            headers["ETag"] = f'"{blob.oid}"'
        data, status = blob.data, 200
        if (wanted := self.headers.get("Range")) and (match := re.fullmatch(r"bytes=(\d+)-(\d*)", wanted)):
            start = int(match[1])
            end = int(match[2]) if match[2] else blob.size - 1
            data, status = blob.data[start : end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{start + len(data) - 1}/{blob.size}"
        self._send(status, data, headers)


def _entries(commit: Commit, base: str, recursive: bool) -> list[dict[str, Any]]:
    prefix = f"{base}/" if base else ""
    inside = sorted(p for p in commit.files if p.startswith(prefix))
    folders = sorted(f for f in _folders(commit) if f.startswith(prefix))
    if not recursive:
        inside = [p for p in inside if "/" not in p[len(prefix) :]]
        folders = [f for f in folders if "/" not in f[len(prefix) :]]
    return [_folder_entry(f) for f in folders] + [_file_entry(p, commit.files[p]) for p in inside]


def _folders(commit: Commit) -> set[str]:
    return {p.rsplit("/", i)[0] for p in commit.files for i in range(1, p.count("/") + 1)}


def _file_entry(path: str, blob: Blob) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "file", "oid": blob.oid, "size": blob.size, "path": path}
    if blob.lfs:
        pointer = lfs_pointer(blob.sha256, blob.size)
        entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": len(pointer)}
    return entry


def _folder_entry(path: str) -> dict[str, Any]:
    return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}


# --- pointing huggingface_hub at it ---------------------------------------------------------------
def point_huggingface_hub_at(monkeypatch: Any, hub: FakeHub, home: Path, token: str | None) -> None:
    """Set the environment a user would (HF_ENDPOINT, HF_HOME, HF_TOKEN) and the huggingface_hub
    constants read from it at import time, which may have happened before this test (another test
    imported transformers). Xet is off: this hub speaks LFS only. monkeypatch undoes it all."""
    import huggingface_hub.constants as constants
    import huggingface_hub.utils.logging  # noqa: F401  configured now, before HF_DEBUG is set (it would stay on)

    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in (
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_TOKEN_PATH",
        "HF_OIDC_RESOURCE",
        "HUGGING_FACE_HUB_TOKEN",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    if token is None:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    values = {
        "ENDPOINT": hub.url,
        "HUGGINGFACE_CO_URL_TEMPLATE": hub.url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HUGGINGFACE_HUB_CACHE": str(home / "hub"),
        "HF_ASSETS_CACHE": str(home / "assets"),
        "HF_XET_CACHE": str(home / "xet"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
        "CHECK_FOR_UPDATE_DONE_PATH": str(home / ".check_for_update_done"),
        "CHECK_FOR_SKILL_UPDATE_DONE_PATH": str(home / ".check_for_skill_update_done"),
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_OFFLINE": False,
        "HF_DEBUG": True,  # log every request as a curl command (the token must be redacted there too)
    }
    for name, value in values.items():
        if hasattr(constants, name):
            monkeypatch.setattr(constants, name, value)


def files_under(root: Path) -> Iterator[Path]:
    return (p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
