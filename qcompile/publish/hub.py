"""`push`: upload a staged artifact to a Hugging Face Hub model repo — only what changed, in one commit.

huggingface_hub does the transport (LFS or Xet for large files, as it decides), finds the endpoint
(HF_ENDPOINT) and the token (HF_TOKEN, or the file `hf auth login` writes). This module decides what
to send: it verifies the staged files against their manifest, compares them with the remote tree
(the LFS sha256, or for small files the git blob sha1), and refuses to overwrite a repo that holds a
different artifact unless forced. A push that died half way (before its commit) is simply run again:
files already there are skipped, and LFS objects already uploaded are not sent twice.

The token goes only into huggingface_hub's Authorization header: never into a message, a log line
or a file.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from qruntime.artifact import MANIFEST, ArtifactFormatError, find_links, read_manifest, sha256_file, verify_files
from qruntime.hub import DEFAULT_REVISION, HUB_METADATA, HubRef, parse_url
from qruntime.hub import HubError as RuntimeHubError
from tqdm import tqdm

from qcompile.errors import ArtifactError, HubError

LOGIN_HINT = "log in with `hf auth login`, or set HF_TOKEN to a token with write access"
_SHOWN = 5  # file names listed in a message before "and N more"


def parse_target(target: str) -> HubRef:
    """`hf://namespace/name[@revision]` -> HubRef(repo_id, revision="main" by default)."""
    try:
        return parse_url(target)
    except RuntimeHubError as exc:
        raise HubError(str(exc)) from None


@dataclass(frozen=True)
class PushReport:
    """What a push did — or, with dry_run, would do. Paths are relative to the artifact."""

    repo_id: str
    revision: str
    repo_url: str
    uploaded: tuple[str, ...]  # new or changed: committed (dry run: would be)
    skipped: tuple[str, ...]  # already on the hub with the same content
    deleted: tuple[str, ...]  # remote files not in this artifact, removed (force, or a new branch)
    created_repo: bool  # the repo did not exist (dry run: would be created)
    dry_run: bool
    commit_url: str | None = None  # None when nothing was committed (a dry run, or nothing changed)
    commit_oid: str | None = None


@dataclass(frozen=True)
class _Local:
    path: Path
    size: int
    sha256: str


@dataclass(frozen=True)
class _Remote:
    repo_exists: bool
    branch_exists: bool
    head: str | None  # the commit the plan compares against
    files: dict[str, Any]  # path -> huggingface_hub RepoFile, hub metadata (.gitattributes) left out


@dataclass(frozen=True)
class _Plan:
    uploads: tuple[str, ...]
    skipped: tuple[str, ...]
    deletes: tuple[str, ...]


def push(
    staged_dir: Path,
    target: str,
    *,
    dry_run: bool = False,
    force: bool = False,
    progress: bool = True,
    private: bool = False,
    commit_message: str | None = None,
) -> PushReport:
    """Upload the artifact in `staged_dir` to `target` (hf://namespace/name[@branch]).

    Every file the manifest lists, and manifest.json, must verify (size, sha256); a file the
    manifest does not list is refused. The repo is created when missing (`private` then applies),
    a missing branch is created from the default branch. Files already on the hub with the same
    content are skipped; the rest go up in one commit. A repo that holds a different artifact
    (another manifest.json), or other files at this artifact's paths, is refused unless `force`,
    which also deletes the remote files this artifact does not have (in the same commit); without
    it, remote files at other paths (a README.md written on the hub) are kept. `dry_run`
    reports what would be uploaded, skipped and deleted, making no write request. `progress`: bars
    on stderr for the verification and huggingface_hub's uploads.
    """
    ref = parse_target(target)
    local = _staged_files(Path(staged_dir), progress)
    hf = _huggingface_hub()
    token = hf.get_token()
    if token is None and not dry_run:
        raise HubError(f"{ref}: no Hugging Face token found; {LOGIN_HINT}")
    api = hf.HfApi(token=token)
    with _hub_errors(hf, ref, token, api.endpoint):
        if not dry_run:
            api.whoami()
        remote = _remote_state(hf, api, ref)
        plan = _plan(ref, local, remote, force)
        report = PushReport(
            repo_id=ref.repo_id,
            revision=ref.revision,
            repo_url=f"{api.endpoint}/{ref.repo_id}",
            uploaded=plan.uploads,
            skipped=plan.skipped,
            deleted=plan.deletes,
            created_repo=not remote.repo_exists,
            dry_run=dry_run,
        )
        if dry_run:
            return report
        if not remote.repo_exists:
            api.create_repo(ref.repo_id, private=private, exist_ok=True)
        if not remote.branch_exists and ref.revision != DEFAULT_REVISION:
            # from the commit the plan was made against, so that the commit below can name it as parent
            api.create_branch(ref.repo_id, branch=ref.revision, revision=remote.head, exist_ok=True)
        if not plan.uploads and not plan.deletes:
            return report
        operations = [_addition(hf, p, local[p]) for p in plan.uploads]
        operations += [hf.CommitOperationDelete(path_in_repo=p) for p in plan.deletes]
        with _hub_progress_bars(hf, progress):
            commit = api.create_commit(
                ref.repo_id,
                operations,
                commit_message=commit_message or _default_message(plan),
                revision=ref.revision,
                parent_commit=remote.head,  # the hub refuses the commit (412) if the branch moved since
            )
    return replace(report, commit_url=str(commit.commit_url), commit_oid=commit.oid)


# --- the local side ------------------------------------------------------------------------------
def _staged_files(root: Path, progress: bool) -> dict[str, _Local]:
    """manifest path -> its file, once every listed file verifies and nothing unlisted is there."""
    try:
        manifest = read_manifest(root)
    except ArtifactFormatError as exc:
        raise ArtifactError(str(exc)) from exc
    files = manifest["files"]
    with tqdm(total=len(files), desc="verify", unit="file", disable=not progress, leave=False) as bar:
        problems = verify_files(root, manifest, progress=lambda _: bar.update())
    if problems:
        raise ArtifactError(
            f"{root}: the staged artifact does not match its manifest:\n  " + "\n  ".join(map(str, problems))
        )
    links = find_links(root)
    if links:
        raise ArtifactError(f"{root}: {_names(links)} are symbolic links; an artifact's files must be its own")
    listed = set(files) | {MANIFEST}
    unlisted = sorted(
        rel for path in root.rglob("*") if path.is_file() and (rel := path.relative_to(root).as_posix()) not in listed
    )
    if unlisted:
        raise ArtifactError(
            f"{root}: {_names(unlisted)} not listed in {MANIFEST}; list them in its `files` or remove them before pushing"
        )
    staged = {rel: _Local(root / rel, info["bytes"], info["sha256"]) for rel, info in files.items()}
    manifest_path = root / MANIFEST
    staged[MANIFEST] = _Local(manifest_path, manifest_path.stat().st_size, sha256_file(manifest_path))
    return staged


def git_blob_sha1(path: Path, block: int = 1 << 20) -> str:
    """The git object id of a file's content: sha1 over "blob <size>\\0" + the bytes."""
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def _addition(hf: ModuleType, rel: str, file: _Local) -> Any:
    operation = hf.CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(file.path))
    with contextlib.suppress(AttributeError):  # verified above: spare huggingface_hub a second read
        operation.upload_info.sha256 = bytes.fromhex(file.sha256)
    return operation


# --- the remote side -----------------------------------------------------------------------------
def _remote_state(hf: ModuleType, api: Any, ref: HubRef) -> _Remote:
    errors = hf.errors
    branch_exists = True
    try:
        info = api.repo_info(ref.repo_id, revision=ref.revision)
    except errors.RevisionNotFoundError:
        branch_exists = False  # the branch will start from the default branch: compare with that
        info = api.repo_info(ref.repo_id)
    except errors.RepositoryNotFoundError:
        return _Remote(repo_exists=False, branch_exists=False, head=None, files={})
    files = {
        entry.path: entry
        for entry in api.list_repo_tree(ref.repo_id, recursive=True, revision=info.sha)
        if isinstance(entry, hf.RepoFile) and entry.path not in HUB_METADATA
    }
    return _Remote(repo_exists=True, branch_exists=branch_exists, head=info.sha, files=files)


def _same(file: _Local, remote: Any) -> bool:
    """Whether a remote file holds these bytes: LFS (and Xet) files by sha256, the others by git blob sha1."""
    if remote.lfs is not None:
        return remote.lfs.sha256 == file.sha256 and remote.lfs.size == file.size
    return remote.size == file.size and remote.blob_id == git_blob_sha1(file.path)


def _plan(ref: HubRef, local: dict[str, _Local], remote: _Remote, force: bool) -> _Plan:
    same = {rel for rel, file in local.items() if rel in remote.files and _same(file, remote.files[rel])}
    # files this push would overwrite; fine when the remote holds this very manifest (an earlier or
    # interrupted push of this artifact), refused otherwise: that is someone else's content
    conflicts = sorted(rel for rel in local if rel in remote.files and rel not in same)
    if conflicts and MANIFEST not in same and remote.branch_exists and not force:
        what = "a different artifact" if MANIFEST in remote.files else "other files at this artifact's paths"
        raise HubError(
            f"{ref} holds {what}: {_names(conflicts)} differ from this artifact; pass force=True (--force) "
            "to replace it, deleting the remote files this artifact does not have"
        )
    replace = force or not remote.branch_exists  # a new branch starts as a copy of the default one
    return _Plan(
        uploads=tuple(rel for rel in local if rel not in same),
        skipped=tuple(rel for rel in local if rel in same),
        deletes=tuple(sorted(rel for rel in remote.files if rel not in local)) if replace else (),
    )


def _default_message(plan: _Plan) -> str:
    message = f"qcompile push: {len(plan.uploads)} new or changed file(s)"
    return message + (f", {len(plan.deletes)} deleted" if plan.deletes else "")


def _names(paths: list[str]) -> str:
    shown = ", ".join(paths[:_SHOWN])
    return shown + (f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else "")


# --- huggingface_hub -----------------------------------------------------------------------------
def _huggingface_hub() -> ModuleType:
    try:
        import huggingface_hub
        import huggingface_hub.errors
        import huggingface_hub.utils
    except ImportError as exc:
        raise HubError(f"pushing needs huggingface_hub: pip install huggingface_hub ({exc})") from exc
    return huggingface_hub


@contextlib.contextmanager
def _hub_progress_bars(hf: ModuleType, enabled: bool) -> Iterator[None]:
    """huggingface_hub's upload bars follow `progress` (a process-wide switch there: restored after)."""
    bars = hf.utils
    if enabled or bars.are_progress_bars_disabled():
        yield
        return
    bars.disable_progress_bars()
    try:
        yield
    finally:
        bars.enable_progress_bars()


@contextlib.contextmanager
def _hub_errors(hf: ModuleType, ref: HubRef, token: str | None, endpoint: str) -> Iterator[None]:
    """huggingface_hub's and the HTTP client's errors -> one HubError line naming the target
    (the token scrubbed from it, should any layer below have echoed it)."""
    transport: list[type[BaseException]] = [hf.errors.HfHubHTTPError, OSError]
    with contextlib.suppress(ImportError):
        import httpx

        transport.append(httpx.HTTPError)
    try:
        yield
    except HubError:
        raise
    except hf.errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status == 401:
            message = f"{ref}: the hub at {endpoint} refused the token (401); {LOGIN_HINT}"
        elif status == 403:
            message = f"{ref}: the token may not write to {ref.repo_id} (403 Forbidden); use one with write access"
        elif status == 412:
            message = f"{ref}: the branch changed while pushing (412); run the push again"
        else:
            message = f"{ref}: {_one_line(exc)}"
        raise HubError(_scrub(message, token)) from exc
    except (*transport, RuntimeError, ValueError) as exc:
        cause = f" ({_one_line(exc.__cause__)})" if exc.__cause__ is not None else ""
        raise HubError(_scrub(f"{ref}: {_one_line(exc)}{cause}", token)) from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "<token>") if token else text
