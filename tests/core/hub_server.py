"""A loopback stand-in for the Hugging Face hub, for download tests (never reaches the network).

It serves checkpoint folders as model repos the way huggingface_hub's `hf_hub_download` expects (read from
huggingface_hub 2.x's file_download.py / utils/_http.py):

- `HEAD|GET {endpoint}/{org}/{name}/resolve/{revision}/{file}` on the hub origin. Small files answer 200 with
  `ETag` (the git blob sha1), `X-Repo-Commit` and `Content-Length`. Weight files (LFS on the real hub) answer
  302 with `Location` on a second origin (the "CDN": another port, so huggingface_hub does not follow the HEAD
  redirect and takes the metadata from the 302 itself) plus `X-Linked-Etag` (sha256) and `X-Linked-Size`.
  File responses carry `Content-Disposition` with the file name, which huggingface_hub shows on its progress bar.
- An unknown repo answers 401 `X-Error-Code: RepoNotFound`, an unknown revision 404 `RevisionNotFound`, a
  missing file 404 `EntryNotFound` — the codes huggingface_hub maps to its error classes.
- Both origins honour `Range: bytes=N-` (206 with `Content-Range`), which is how huggingface_hub resumes.
- `GET /api/models?search=&filter=&sort=&limit=&expand=` (HfApi.list_models) answers the repos whose id contains
  the search text (case-insensitive) and whose tags hold every filter, most downloads first; and
  `GET /api/models/{repo}[/revision/{rev}][?blobs=True]` (HfApi.model_info) answers one repo with its files
  (`siblings`, with sizes and LFS hashes when `blobs` is asked). What a repo says of itself is derived from its
  files (tags `gguf`/`safetensors` and the architecture; `config.model_type` from config.json;
  `gguf.architecture`/`total` from the GGUF metadata; `safetensors.parameters` per dtype from the headers) and
  overridden by `cards[repo]` (e.g. `{"downloads": 10}`).

Faults for tests: `fail_repo[repo] = status` answers every resolve of that repo with the status (with
`Retry-After: 0`, so huggingface_hub's retries do not sleep long), and `drop_once[file] = fraction` makes the
first full GET of that file send that fraction of the body and then close the connection; `stall_after[file] =
nbytes` makes the first full GET of that file send nbytes and then hold the connection open, sending nothing more,
until `close()` (a download a test can kill mid-way).

Every request is logged (`requests`), so a test can assert what was fetched. Bound to 127.0.0.1 only; `close()`
(or leaving the `with` block) stops both servers and joins their threads.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<file>.+)$")
_BLOB = re.compile(r"^/repos/(?P<repo>[^/]+/[^/]+)/(?P<sha256>[0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(?P<start>\d+)-$")
_API_MODEL = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<revision>[^/]+))?/?$")
# safetensors dtype -> the hub's name for it in `safetensors.parameters`
_ST_DTYPES = {"F64": "F64", "F32": "F32", "F16": "F16", "BF16": "BF16", "I64": "I64", "I32": "I32", "I8": "I8",
              "U8": "U8", "BOOL": "BOOL"}


@dataclass(frozen=True)
class LoggedRequest:
    origin: str  # "hub", "cdn" or "api" (the hub origin's /api/models)
    method: str  # HEAD or GET
    repo: str | None
    file: str  # the repo file name (for CDN requests, the file the blob belongs to)
    range: str | None  # the Range header, if any
    status: int


@dataclass
class _File:
    path: Path
    size: int
    git_sha1: str  # what the hub sends as ETag for a regular file
    sha256: str  # what it sends as X-Linked-Etag for an LFS file

    @property
    def is_lfs(self) -> bool:
        return self.path.name.endswith(LFS_SUFFIXES)


def _hash_file(path: Path) -> _File:
    data = path.read_bytes()
    git_sha1 = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return _File(path, len(data), git_sha1, hashlib.sha256(data).hexdigest())


class _Repo:
    def __init__(self, folder: Path):
        self.files = {p.relative_to(folder).as_posix(): _hash_file(p) for p in sorted(folder.rglob("*"))
                      if p.is_file()}
        tree = "".join(f"{name} {f.git_sha1}\n" for name, f in self.files.items())
        self.commit = hashlib.sha1(tree.encode()).hexdigest()  # any 40-hex id that changes with the content
        self.card = _card(self.files)

    def siblings(self, blobs: bool) -> list[dict]:
        """The `siblings` of the hub's model info: file names, and with `blobs` sizes and LFS hashes."""
        found = []
        for name, f in self.files.items():
            entry: dict = {"rfilename": name}
            if blobs:
                entry.update(size=f.size, blobId=f.git_sha1)
                if f.is_lfs:
                    entry["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
            found.append(entry)
        return found


def _card(files: dict[str, _File]) -> dict:
    """What the hub says of a repo, derived from its files: tags, config, gguf and safetensors summaries."""
    card: dict = {"tags": [], "downloads": 0, "likes": 0, "library_name": None}
    config = files.get("config.json")
    if config is not None:
        model_type = json.loads(config.path.read_text()).get("model_type")
        card["config"] = {"model_type": model_type}
        card["tags"].append(model_type)
    weights = [f for n, f in files.items() if n.endswith(".safetensors")]
    if weights:
        counts: dict[str, int] = {}
        for f in weights:
            for dtype, n in _safetensors_counts(f.path).items():
                counts[dtype] = counts.get(dtype, 0) + n
        card["safetensors"] = {"parameters": counts, "total": sum(counts.values())}
        card["tags"].append("safetensors")
    ggufs = [f for n, f in files.items() if n.endswith(".gguf")]
    if ggufs:
        import gguf

        reader = gguf.GGUFReader(str(ggufs[0].path))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
        card["gguf"] = {"architecture": arch, "total": int(sum(t.n_elements for t in reader.tensors))}
        card["tags"] += ["gguf", arch]
    return card


def _safetensors_counts(path: Path) -> dict[str, int]:
    """Parameters per dtype, from a safetensors file's JSON header."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    counts: dict[str, int] = {}
    for name, entry in header.items():
        if name != "__metadata__":
            n = 1
            for dim in entry["shape"]:
                n *= dim
            dtype = _ST_DTYPES.get(entry["dtype"], entry["dtype"])
            counts[dtype] = counts.get(dtype, 0) + n
    return counts


class LoopbackHub:
    """Serves {repo_id: folder} on 127.0.0.1 as Hugging Face model repos (revision `main` or the commit id)."""

    def __init__(self, repos: dict[str, Path], cards: dict[str, dict] | None = None):
        self.repos = {repo_id: _Repo(Path(folder)) for repo_id, folder in repos.items()}
        for repo_id, card in (cards or {}).items():
            self.repos[repo_id].card.update(card)
        self.fail_repo: dict[str, int] = {}
        self.drop_once: dict[str, float] = {}
        self.stall_after: dict[str, int] = {}
        self.closing = threading.Event()  # set by close(): a stalled response ends
        self.requests: list[LoggedRequest] = []
        self._lock = threading.Lock()
        self._blobs = {(repo_id, f.sha256): (name, f) for repo_id, repo in self.repos.items()
                       for name, f in repo.files.items() if f.is_lfs}
        self._hub = self._serve("hub")
        self._cdn = self._serve("cdn")

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def _serve(self, origin: str) -> tuple[ThreadingHTTPServer, threading.Thread]:
        handler = type(f"{origin.title()}Handler", (_Handler,), {"hub": self, "origin": origin})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                  name=f"loopback-{origin}", daemon=True)
        thread.start()
        return server, thread

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._hub[0].server_address[1]}"

    @property
    def cdn_endpoint(self) -> str:
        return f"http://127.0.0.1:{self._cdn[0].server_address[1]}"

    def close(self) -> None:
        self.closing.set()
        for server, thread in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

    def __enter__(self) -> "LoopbackHub":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what tests look at ------------------------------------------------------------------------------------
    def log(self, entry: LoggedRequest) -> None:
        with self._lock:
            self.requests.append(entry)

    def downloaded(self, repo: str | None = None) -> list[str]:
        """Files whose content was sent (GET with a 200/206), in request order; a resumed file appears twice."""
        with self._lock:
            return [r.file for r in self.requests if r.origin != "api"
                    and r.method == "GET" and r.status in (200, 206) and (repo is None or r.repo == repo)]

    def range_requests(self) -> list[LoggedRequest]:
        with self._lock:
            return [r for r in self.requests if r.range is not None]

    def commit_of(self, repo: str) -> str:
        return self.repos[repo].commit


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the hub; every response carries a Content-Length
    hub: LoopbackHub
    origin: str

    def log_message(self, format, *args) -> None:  # the test log records requests; keep pytest output clean
        pass

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def _answer(self, send_body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        if self.origin == "hub" and path.startswith("/api/models"):
            self._api(path, parse_qs(urlsplit(self.path).query))
        elif self.origin == "hub":
            self._resolve(path, send_body)
        else:
            self._blob(path, send_body)

    # -- the hub origin: /{repo}/resolve/{revision}/{file} -----------------------------------------------------
    def _resolve(self, path: str, send_body: bool) -> None:
        match = _RESOLVE.match(path)
        if match is None:
            return self._error(None, path, 404, {"X-Error-Code": "EntryNotFound"})
        repo_id, revision, name = match["repo"], match["revision"], match["file"]
        repo = self.hub.repos.get(repo_id)
        if repo_id in self.hub.fail_repo:
            status = self.hub.fail_repo[repo_id]
            return self._error(repo_id, name, status, {"Retry-After": "0"})
        if repo is None:  # the hub answers 401 for a missing (or private) repo to anonymous users
            return self._error(repo_id, name, 401, {"X-Error-Code": "RepoNotFound",
                                                    "X-Error-Message": "Repository not found"})
        if revision not in ("main", repo.commit):
            return self._error(repo_id, name, 404, {"X-Error-Code": "RevisionNotFound"})
        file = repo.files.get(name)
        if file is None:
            return self._error(repo_id, name, 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit})
        if file.is_lfs:
            headers = {"Location": f"{self.hub.cdn_endpoint}/repos/{repo_id}/{file.sha256}",
                       "X-Repo-Commit": repo.commit,
                       "X-Linked-Etag": f'"{file.sha256}"', "X-Linked-Size": str(file.size),
                       "ETag": f'"{file.git_sha1}"'}
            self.hub.log(LoggedRequest("hub", self.command, repo_id, name, self.headers.get("Range"), 302))
            return self._reply(302, headers, b"")
        self._send_file(repo_id, name, file, send_body, {"X-Repo-Commit": repo.commit,
                                                        "ETag": f'"{file.git_sha1}"'})

    # -- the hub's API: /api/models (list_models) and /api/models/{repo} (model_info) ----------------------------
    def _api(self, path: str, query: dict[str, list[str]]) -> None:
        if path.rstrip("/") == "/api/models":
            return self._json(None, path, 200, self._listing(query))
        match = _API_MODEL.match(path)
        repo = self.hub.repos.get(match["repo"]) if match else None
        if repo is None:
            return self._error(match["repo"] if match else None, path, 401,
                               {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
        if match["revision"] not in (None, "main", repo.commit):
            return self._error(match["repo"], path, 404, {"X-Error-Code": "RevisionNotFound"})
        blobs = query.get("blobs", [""])[0].lower() == "true"
        info = {"id": match["repo"], "sha": repo.commit, **repo.card, "siblings": repo.siblings(blobs)}
        self._json(match["repo"], path, 200, info)

    def _listing(self, query: dict[str, list[str]]) -> list[dict]:
        text = query.get("search", [""])[0].lower()
        filters = query.get("filter", [])
        expand = query.get("expand", [])
        found = [(repo_id, repo) for repo_id, repo in self.hub.repos.items()
                 if text in repo_id.lower() and all(f in repo.card["tags"] for f in filters)]
        found.sort(key=lambda item: -item[1].card.get("downloads", 0))
        limit = int(query.get("limit", [len(found)])[0])
        answer = []
        for repo_id, repo in found[:limit]:
            fields = {k: v for k, v in repo.card.items() if not expand or k in expand}
            answer.append({"id": repo_id, "_id": repo.commit[:24], **fields})
        return answer

    def _json(self, repo_id: str | None, path: str, status: int, value) -> None:
        self.hub.log(LoggedRequest("api", self.command, repo_id, path, None, status))
        body = json.dumps(value).encode()
        self._reply(status, {"Content-Type": "application/json"}, body if self.command == "GET" else b"",
                    content_length=len(body))

    # -- the CDN origin: /repos/{repo}/{sha256} ----------------------------------------------------------------
    def _blob(self, path: str, send_body: bool) -> None:
        match = _BLOB.match(path)
        found = self.hub._blobs.get((match["repo"], match["sha256"])) if match else None
        if found is None:
            return self._error(None, path, 404, {})
        repo_id = match["repo"]
        name, file = found
        self._send_file(repo_id, name, file, send_body, {"ETag": f'"{file.sha256}"'})

    # -- responses ---------------------------------------------------------------------------------------------
    def _send_file(self, repo_id: str, name: str, file: _File, send_body: bool, headers: dict[str, str]) -> None:
        data = file.path.read_bytes()
        range_header = self.headers.get("Range")
        start = 0
        if range_header is not None:
            match = _RANGE.match(range_header.strip())
            if match is None or int(match["start"]) >= len(data):
                self.hub.log(LoggedRequest(self.origin, self.command, repo_id, name, range_header, 416))
                return self._reply(416, {"Content-Range": f"bytes */{len(data)}"}, b"")
            start = int(match["start"])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        status = 206 if range_header is not None else 200
        headers["Accept-Ranges"] = "bytes"
        headers["Content-Type"] = "application/octet-stream"
        # huggingface_hub names its progress bar after this header (else after the URL, a blob hash for LFS files)
        base = Path(name).name
        headers["Content-Disposition"] = f"inline; filename*=UTF-8''{quote(base)}; filename=\"{base}\";"
        self.hub.log(LoggedRequest(self.origin, self.command, repo_id, name, range_header, status))
        body = data[start:]
        fraction = self._take_fault(self.hub.drop_once, name) if send_body and start == 0 else None
        drop_after = None if fraction is None else int(fraction * len(body))
        stall_after = self._take_fault(self.hub.stall_after, name) if send_body and start == 0 else None
        if stall_after is not None:
            return self._stall(status, headers, body, stall_after)
        self._reply(status, headers, body if send_body else b"", content_length=len(body), drop_after=drop_after)

    def _take_fault(self, faults: dict, name: str):
        with self.hub._lock:
            return faults.pop(name, None)

    def _stall(self, status: int, headers: dict[str, str], body: bytes, nbytes: int) -> None:
        """Send the headers and `nbytes` of the body, then nothing until the hub closes (or the client goes)."""
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body[:nbytes])
        self.wfile.flush()
        self.hub.closing.wait(timeout=120)
        self.close_connection = True

    def _error(self, repo_id: str | None, name: str, status: int, headers: dict[str, str]) -> None:
        self.hub.log(LoggedRequest(self.origin, self.command, repo_id, name, self.headers.get("Range"), status))
        body = b"" if self.command == "HEAD" else f'{{"error": "{headers.get("X-Error-Code", status)}"}}'.encode()
        self._reply(status, {"Content-Type": "application/json", **headers}, body,
                    content_length=len(body))

    def _reply(self, status: int, headers: dict[str, str], body: bytes, content_length: int | None = None,
               drop_after: int | None = None) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        self.end_headers()
        if drop_after is not None:
            # the header promised the whole file: the client sees the connection end early, as on a network cut
            self.wfile.write(body[:drop_after])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if body:
            self.wfile.write(body)
