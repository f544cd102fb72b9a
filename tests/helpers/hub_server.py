"""A Hugging Face Hub on 127.0.0.1 for tests: the HTTP endpoints huggingface_hub calls, so its real client code runs.

`HubServer` (stdlib http.server in a thread) serves repos held in memory and
answers what `snapshot_download` asks -- the revision info
(`/api/{models,datasets}/{repo}/revision/{rev}`), the file tree
(`/api/.../tree/{rev}`), and `resolve/{rev}/{file}` with HEAD, GET and Range,
carrying X-Repo-Commit, ETag, X-Linked-Etag / X-Linked-Size and
Content-Length -- and what `create_repo` + `upload_folder` send (`/api/repos/create`,
`preupload`, the NDJSON `commit`; every file is "regular", so no LFS transfer).
Private repos check the bearer token (401 without it, with the hub's
X-Error-Code / X-Error-Message headers); a missing repo or revision is a 404
the client reads as RepositoryNotFoundError / RevisionNotFoundError. `log`
records every request; `cut_after[path] = n` makes the first GET of that file
stop after n bytes, as a dropped connection does. Point HF_ENDPOINT at `url`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple
from urllib.parse import unquote, urlparse


def _git_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    repo_type: str
    private: bool = False
    commits: Dict[str, Dict[str, bytes]] = field(default_factory=dict)  # commit -> files
    refs: Dict[str, str] = field(default_factory=dict)  # branch -> commit

    def commit(self, rev: str) -> Optional[str]:
        return self.refs.get(rev) or (rev if rev in self.commits else None)


class HubServer:
    """The hub's HTTP protocol over in-memory repos; `with HubServer(token="hf_x") as hub: hub.url`."""

    def __init__(self, token: Optional[str] = None, user: str = "tester") -> None:
        self.token, self.user = token, user  # a repo created without an organisation goes to `user`
        self.repos: Dict[Tuple[str, str], Repo] = {}
        self.log: List[Tuple[str, str, int]] = []  # (method, path, status)
        self.cut_after: Dict[str, int] = {}
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def add_repo(
        self,
        repo_id: str,
        files: Dict[str, bytes],
        repo_type: str = "model",
        private: bool = False,
        branch: str = "main",
    ) -> str:
        """A new commit of `files` on `branch`; returns its hash."""
        repo = self.repos.setdefault((repo_type, repo_id), Repo(repo_type, private))
        sha = hashlib.sha1(json.dumps(sorted((k, _git_sha(v)) for k, v in files.items())).encode() + branch.encode())
        commit = sha.hexdigest()
        repo.commits[commit] = dict(files)
        repo.refs[branch] = commit
        return commit

    def file_gets(self, name: str) -> int:
        """How many GETs of a file named `name` (any repo, any revision) were answered."""
        return sum(1 for m, p, s in self.log if m == "GET" and "/resolve/" in p and p.endswith("/" + name) and s < 300)

    def files(self, repo_id: str, repo_type: str = "model", rev: str = "main") -> Dict[str, bytes]:
        repo = self.repos[(repo_type, repo_id)]
        return repo.commits[repo.commit(rev)]


_TYPES = {"models": "model", "datasets": "dataset"}


def _handler(hub: HubServer) -> type:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # the request log is hub.log
            pass

        # ------------------------------------------------------------ plumbing
        def _send(self, status: int, body: bytes = b"", headers: Optional[Dict[str, str]] = None) -> None:
            with hub.lock:
                hub.log.append((self.command, urlparse(self.path).path, status))
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, status: int, value: object, headers: Optional[Dict[str, str]] = None) -> None:
            self._send(status, json.dumps(value).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _error(self, status: int, code: Optional[str], message: str) -> None:
            headers = {"X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            self._json(status, {"error": message}, headers)

        def _authorised(self, repo: Optional[Repo], write: bool = False) -> bool:
            given = self.headers.get("Authorization", "")
            if (repo is None or not repo.private) and not write:
                return True
            if given == f"Bearer {hub.token}" and hub.token:
                return True
            if given:
                self._error(401, None, "Invalid credentials in Authorization header")
            else:
                self._error(401, "RepoNotFound", "Repository not found")
            return False

        def _repo(self, repo_type: str, repo_id: str) -> Optional[Repo]:
            repo = hub.repos.get((repo_type, repo_id))
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            return repo if self._authorised(repo) else None

        def _commit(self, repo: Repo, rev: str) -> Optional[str]:
            commit = repo.commit(unquote(rev))
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return commit

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        # ------------------------------------------------------------ routes
        def do_HEAD(self) -> None:
            self._resolve()

        def do_GET(self) -> None:
            path = urlparse(self.path).path
            if path == "/api/agent-harnesses":  # huggingface_hub's user-agent registry: empty here
                return self._json(200, {})
            m = re.match(r"^/api/(models|datasets)/([^/]+/[^/]+)/(revision|tree)/([^/]+)(/.*)?$", path)
            if m:
                repo = self._repo(_TYPES[m.group(1)], m.group(2))
                commit = repo and self._commit(repo, m.group(4))
                if not commit:
                    return
                files = repo.commits[commit]
                if m.group(3) == "revision":
                    return self._json(
                        200,
                        {
                            "id": m.group(2),
                            "sha": commit,
                            "private": repo.private,
                            "siblings": [{"rfilename": f} for f in sorted(files)],
                        },
                    )
                return self._json(200, [self._entry(name, data) for name, data in sorted(files.items())])
            self._resolve()

        def _entry(self, name: str, data: bytes) -> Dict[str, object]:
            entry: Dict[str, object] = {"type": "file", "oid": _git_sha(data), "size": len(data), "path": name}
            if name.endswith(".safetensors"):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            return entry

        def _resolve(self) -> None:
            path = urlparse(self.path).path
            m = re.match(r"^/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            if not m:
                return self._error(404, None, f"no route {path}")
            repo = self._repo("dataset" if m.group(1) else "model", m.group(2))
            commit = repo and self._commit(repo, m.group(3))
            if not commit:
                return
            name = unquote(m.group(4))
            data = repo.commits[commit].get(name)
            if data is None:
                return self._error(404, "EntryNotFound", f"{name} does not exist")
            etag = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else _git_sha(data)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
            if name.endswith(".safetensors"):
                headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
            wanted = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if self.command == "GET" and wanted:
                start = int(wanted.group(1))
                end = int(wanted.group(2)) if wanted.group(2) else len(data) - 1
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                return self._send(206, data[start : end + 1], headers)
            cut = hub.cut_after.pop(path, None) if self.command == "GET" else None
            if cut is None:
                return self._send(200, data, headers)
            with hub.lock:  # the stream stops half-way: headers promise the whole file, the socket closes early
                hub.log.append((self.command, path, 599))
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:cut])
            self.wfile.flush()
            self.close_connection = True

        def do_POST(self) -> None:
            path = urlparse(self.path).path
            body = self._body()
            if path == "/api/repos/create":
                if not self._authorised(None, write=True):
                    return
                req = json.loads(body)
                repo_id = f"{req.get('organization') or hub.user}/{req['name']}"
                key = (req.get("type") or "model", repo_id)
                if key in hub.repos:  # the hub names the existing repo, which create_repo(exist_ok=True) returns
                    message = "You already created this model repo"
                    return self._json(
                        409, {"error": message, "url": f"{hub.url}/{repo_id}"}, {"X-Error-Message": message}
                    )
                hub.repos[key] = Repo(key[0], private=req.get("visibility") == "private" or bool(req.get("private")))
                return self._json(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
            m = re.match(r"^/api/(models|datasets)/([^/]+/[^/]+)/(preupload|commit)/([^/]+)$", path)
            if not m:
                return self._error(404, None, f"no route {path}")
            if not self._authorised(None, write=True):
                return
            repo = self._repo(_TYPES[m.group(1)], m.group(2))
            if repo is None:
                return
            if m.group(3) == "preupload":
                files = json.loads(body)["files"]
                return self._json(
                    200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
                )
            branch = unquote(m.group(4))
            parent = repo.refs.get(branch)
            files = dict(repo.commits[parent]) if parent else {}
            for line in body.decode().splitlines():
                if not line.strip():
                    continue
                item = json.loads(line)
                if item["key"] == "file":
                    files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] in ("deletedFile", "deletedFolder"):
                    files = {k: v for k, v in files.items() if not k.startswith(item["value"]["path"])}
                elif item["key"] != "header":
                    return self._error(400, None, f"unsupported commit operation {item['key']}")
            commit = hub.add_repo(m.group(2), files, repo.repo_type, repo.private, branch)
            return self._json(
                200,
                {"commitUrl": f"{hub.url}/{m.group(2)}/commit/{commit}", "commitOid": commit, "pullRequestUrl": None},
            )

    return Handler


def lay_cache(cache: str, repo_id: str, files: Dict[str, bytes], repo_type: str = "model", branch: str = "main") -> str:
    """A repo laid in a hub cache folder as a download leaves it: blobs/<etag>, snapshots/<commit>/<file> linking
    to the blob, refs/<branch> naming the commit. Returns the snapshot folder."""
    import os

    storage = os.path.join(cache, f"{repo_type}s--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(json.dumps(sorted((k, _git_sha(v)) for k, v in files.items())).encode()).hexdigest()
    snapshot = os.path.join(storage, "snapshots", commit)
    for name, data in files.items():
        etag = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else _git_sha(data)
        blob = os.path.join(storage, "blobs", etag)
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        with open(blob, "wb") as fh:
            fh.write(data)
        link = os.path.join(snapshot, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
    with open(os.path.join(storage, "refs", branch), "w") as fh:
        fh.write(commit)
    return snapshot


def folder_files(folder: str) -> Dict[str, bytes]:
    """Every file under `folder` by its '/'-separated relative path (a model folder as repo contents)."""
    import os

    out = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder).replace(os.sep, "/")] = fh.read()
    return out


def point_at(monkeypatch: object, server: HubServer, hf_home: str) -> str:
    """This process (huggingface_hub's constants, read at import) and the processes it starts (the environment)
    use `server` as the hub and `hf_home` as HF_HOME, online; returns the hub cache folder."""
    import os

    from huggingface_hub import constants

    cache = os.path.join(hf_home, "hub")
    for name, value in (
        ("HF_HUB_CACHE", cache),
        ("ENDPOINT", server.url),
        ("HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"),
        ("HF_HUB_OFFLINE", False),
    ):
        monkeypatch.setattr(constants, name, value)
    for name, value in (("HF_HOME", hf_home), ("HF_ENDPOINT", server.url), ("HF_HUB_DISABLE_PROGRESS_BARS", "1")):
        monkeypatch.setenv(name, value)
    for name in ("HF_TOKEN", "HF_HUB_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return cache


__all__ = ["HubServer", "Repo", "folder_files", "lay_cache", "point_at"]
