"""Artifacts through the Hugging Face Hub — `qcompile.publish.hub.push`, `qruntime.hub.pull`,
`qruntime.load("hf://…")`, `qcompile pull` / `qruntime pull` — against a fake hub on loopback
(tests/hubserver.py) that speaks the routes huggingface_hub uses.

Each test gets its own hub, HF_HOME and a fresh random token; its teardown checks that the token
went nowhere but the Authorization header of requests. The artifacts come from random-seeded tiny
checkpoints, fresh each run.
"""

import json
import logging
import random
import re
import secrets
import shutil

import pytest
import qruntime
from click.testing import CliRunner
from hubserver import FakeHub, files_under, point_huggingface_hub_at
from qruntime import hub as runtime_hub
from qruntime.artifact import MANIFEST, sha256_file
from qruntime.cli import main as qruntime_main

from qcompile.cli import main as qcompile_main
from qcompile.errors import ArtifactError, HubError
from qcompile.publish.hub import PushReport, git_blob_sha1, parse_target, push

REPO = "org/tiny-fp8"
URL = f"hf://{REPO}"
SMALL_CACHE = {"num_kv_blocks": 64}


# --- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def art_a(compiled, make_ckpt):
    return compiled(make_ckpt("tiny", seed=random.randrange(1, 1 << 30)), "ptpc-fp8")


@pytest.fixture(scope="module")
def art_b(compiled, make_ckpt):
    """Another artifact with the same file names as art_a (other weights, other manifest)."""
    return compiled(make_ckpt("tiny", seed=random.randrange(1 << 30, 1 << 31)), "ptpc-fp8")


@pytest.fixture
def token():
    return "hf_" + secrets.token_urlsafe(24)


@pytest.fixture
def hub(token, tmp_path, monkeypatch):
    """A fake hub that huggingface_hub talks to (HF_ENDPOINT, HF_HOME=tmp/hf-home, HF_TOKEN=token)."""
    with FakeHub(token) as fake:
        point_huggingface_hub_at(monkeypatch, fake, tmp_path / "hf-home", token)
        yield fake
    assert fake.token_leaks() == []
    assert all(r.header("Authorization") is None for r in fake.requests if r.path.startswith("/lfs-storage/"))


def artifact_files(root):
    """relative path -> bytes of an artifact directory (every file, manifest.json included)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def remote_files(hub, revision="main"):
    files = hub.files(REPO, revision)
    assert files.pop(".gitattributes").startswith(b"*.safetensors filter=lfs")
    return files


def writes(requests):
    return [f"{r.method} {r.path}" for r in requests if r.method not in ("GET", "HEAD")]


def leftovers(parent, name):
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


def staged_copy(art, tmp_path, name="staged"):
    return shutil.copytree(art, tmp_path / name)


# --- names ---------------------------------------------------------------------------------------
def test_parse_target():
    assert parse_target("hf://org/name") == runtime_hub.HubRef("org/name", "main")
    assert parse_target("hf://Org-1/my_model.v2@v1.0") == runtime_hub.HubRef("Org-1/my_model.v2", "v1.0")
    assert parse_target("hf://org/name@refs/pr/3").revision == "refs/pr/3"
    assert str(parse_target("hf://org/name@dev")) == "hf://org/name@dev"
    bad = ["org/name", "hf://name", "hf://org/name/extra", "hf://org/", "hf://-org/name", "hf://org/na--me",
           "hf://org/name.", "hf://org/name@", "hf://org/name@a b", "hf://org/name@../x", "hf://or g/name"]  # fmt: skip
    for target in bad:
        with pytest.raises(HubError, match=re.escape(repr(target))):
            parse_target(target)
    with pytest.raises(runtime_hub.HubError, match="disagree"):
        runtime_hub.parse_url("hf://org/name@a", revision="b")


# --- push ----------------------------------------------------------------------------------------
def test_push_uploads_every_file_then_nothing(hub, art_a):
    local = artifact_files(art_a)
    report = push(art_a, URL, progress=False)
    assert isinstance(report, PushReport)
    assert sorted(report.uploaded) == sorted(local) and report.skipped == () and report.deleted == ()
    assert report.created_repo and report.commit_oid == hub.head(REPO)
    assert report.commit_url == f"{hub.url}/{REPO}/commit/{report.commit_oid}"
    assert remote_files(hub) == local
    # the shard and the graph went through LFS (their bytes PUT to storage), the JSON files inline
    assert hub.lfs_paths(REPO) == {p for p in local if p.endswith((".safetensors", ".onnx"))}
    assert len([r for r in hub.requests if r.method == "PUT"]) == len(hub.lfs_paths(REPO))

    mark = hub.mark()
    again = push(art_a, URL, progress=False)
    assert again.uploaded == () and sorted(again.skipped) == sorted(local) and again.commit_oid is None
    assert not again.created_repo
    assert writes(hub.requests[mark:]) == []  # no commit, no upload, not even a preupload
    assert hub.head(REPO) == report.commit_oid


def test_rerun_after_interrupted_push_sends_only_what_is_missing(hub, art_a):
    local = artifact_files(art_a)
    hub.fail_next("commit", 500, "the connection dropped")
    with pytest.raises(HubError, match=rf"{URL}: .*500"):
        push(art_a, URL, progress=False)
    assert remote_files(hub) == {}  # the LFS objects went up, the commit did not
    uploaded_before = [r.path for r in hub.requests if r.method == "PUT"]
    assert len(uploaded_before) == len({p for p in local if p.endswith((".safetensors", ".onnx"))})

    mark = hub.mark()
    report = push(art_a, URL, progress=False)
    assert sorted(report.uploaded) == sorted(local) and not report.created_repo
    assert remote_files(hub) == local
    assert [r for r in hub.requests[mark:] if r.method == "PUT"] == []  # the LFS batch said: already there

    # a file lost on the hub's side (deleted there): the next push sends exactly that one
    lost = random.choice(sorted(local))
    hub.server_commit(REPO, f"delete {lost}", delete=(lost,))
    report = push(art_a, URL, progress=False)
    assert report.uploaded == (lost,) and len(report.skipped) == len(local) - 1
    assert remote_files(hub) == local


def test_a_branch_that_moved_meanwhile_is_not_overwritten(hub, art_a, art_b):
    push(art_a, URL, progress=False)
    hub.fail_next("commit", 412, "A commit has happened since. Please refresh and try again.")
    with pytest.raises(HubError, match=rf"{URL}: the branch changed while pushing \(412\); run the push again"):
        push(art_b, URL, force=True, progress=False)
    assert remote_files(hub) == artifact_files(art_a)
    # and for real: the commit names the head the plan was made against
    assert json.loads(hub.requests[-1].body.splitlines()[0])["value"]["parentCommit"] == hub.head(REPO)


def test_dry_run_makes_no_write_request(hub, art_a, art_b):
    local = artifact_files(art_a)
    mark = hub.mark()
    report = push(art_a, URL, dry_run=True, progress=False)
    assert report.dry_run and report.created_repo and sorted(report.uploaded) == sorted(local)
    assert report.commit_oid is None
    assert writes(hub.requests[mark:]) == [] and REPO not in hub.repos

    push(art_a, URL, progress=False)
    hub.server_commit(REPO, "add a stray file", add={"notes.txt": secrets.token_bytes(64).hex().encode()})
    head = hub.head(REPO)
    mark = hub.mark()
    report = push(art_b, URL, dry_run=True, force=True, progress=False)
    assert report.deleted == ("notes.txt",) and MANIFEST in report.uploaded
    assert writes(hub.requests[mark:]) == [] and hub.head(REPO) == head


def test_different_artifact_is_refused_unless_forced(hub, art_a, art_b):
    push(art_a, URL, progress=False)
    stray = {"extra/stale.bin": secrets.token_bytes(1000), "README.md": b"# someone's notes\n"}
    hub.server_commit(REPO, "add files", add=stray)
    before = remote_files(hub)
    with pytest.raises(HubError, match=r"holds a different artifact: .*manifest\.json.* differ .* force"):
        push(art_b, URL, progress=False)
    assert remote_files(hub) == before

    # the same artifact with extra remote files is not a different one: the extras stay
    assert push(art_a, URL, progress=False).deleted == ()

    report = push(art_b, URL, force=True, progress=False)
    assert report.deleted == ("README.md", "extra/stale.bin")
    assert remote_files(hub) == artifact_files(art_b)
    assert ".gitattributes" in hub.files(REPO)  # hub metadata is never deleted
    # weights differ, the tokenizer files do not: only what changed went up
    unchanged = {p for p, data in artifact_files(art_a).items() if artifact_files(art_b)[p] == data}
    assert set(report.skipped) == unchanged and unchanged.isdisjoint(report.uploaded)


def test_repo_made_on_the_hub_keeps_its_own_files(hub, art_a, art_b):
    """A repo created in the web UI with a README: the push adds the artifact beside it. One whose
    files sit at the artifact's paths is someone else's content: refused without force."""
    hub.create_repo(REPO)
    card = {"README.md": f"# {secrets.token_hex(8)}\n".encode()}
    hub.server_commit(REPO, "add a model card", add=card)
    report = push(art_a, URL, progress=False)
    assert report.deleted == () and not report.created_repo
    assert remote_files(hub) == artifact_files(art_a) | card

    other = "org/other"
    hub.create_repo(other)
    hub.server_commit(other, "someone's model", add={"config.json": b"{}\n"})
    with pytest.raises(
        HubError, match=r"hf://org/other holds other files at this artifact's paths: config\.json differ"
    ):
        push(art_b, f"hf://{other}", progress=False)


def test_push_to_a_new_branch_then_pull_it(hub, art_a, art_b, tmp_path):
    push(art_a, URL, progress=False)
    report = push(art_b, f"{URL}@v2", progress=False)  # a new branch: no force needed
    assert report.revision == "v2" and not report.created_repo
    assert remote_files(hub, "v2") == artifact_files(art_b) and remote_files(hub, "main") == artifact_files(art_a)
    out = runtime_hub.pull(f"{URL}@v2", tmp_path / "v2", progress=False)
    assert artifact_files(out) == artifact_files(art_b)


def test_push_with_model_card_and_wheel(hub, art_a, tmp_path):
    """What publish stages besides the compiled files: README.md (checked by the hub's YAML
    validation) and the runtime wheel (an LFS file), both listed in the manifest."""
    staged = staged_copy(art_a, tmp_path)
    (staged / "README.md").write_text(f"---\nlicense: apache-2.0\ntags: [fp8]\n---\n# {secrets.token_hex(8)}\n")
    (staged / "runtime").mkdir()
    (staged / "runtime" / "qcompile_runtime-0.1.0-py3-none-any.whl").write_bytes(secrets.token_bytes(3000))
    manifest = json.loads((staged / MANIFEST).read_text())
    for rel in ("README.md", "runtime/qcompile_runtime-0.1.0-py3-none-any.whl"):
        manifest["files"][rel] = {"sha256": sha256_file(staged / rel), "bytes": (staged / rel).stat().st_size}
    (staged / MANIFEST).write_text(json.dumps(manifest, indent=1))
    push(staged, URL, progress=False)
    assert remote_files(hub) == artifact_files(staged)
    assert "runtime/qcompile_runtime-0.1.0-py3-none-any.whl" in hub.lfs_paths(REPO)
    assert any(r.path == "/api/validate-yaml" for r in hub.requests)


def test_push_refuses_a_staged_dir_that_does_not_verify(hub, art_a, tmp_path):
    staged = staged_copy(art_a, tmp_path)
    victim = random.choice(sorted(json.loads((staged / MANIFEST).read_text())["files"]))
    data = bytearray((staged / victim).read_bytes())
    data[random.randrange(len(data))] ^= 0x01
    (staged / victim).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=rf"{re.escape(victim)}: sha256 does not match"):
        push(staged, URL, progress=False)
    shutil.copy(art_a / victim, staged / victim)
    (staged / "kernels").mkdir(exist_ok=True)
    (staged / "kernels" / "unlisted.json").write_text("{}")
    with pytest.raises(ArtifactError, match=r"kernels/unlisted\.json not listed in manifest\.json"):
        push(staged, URL, progress=False)
    assert hub.requests == []  # refused before any request


def test_token_missing_or_refused(hub, art_a, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HubError, match=r"no Hugging Face token found; log in with `hf auth login`"):
        push(art_a, URL, progress=False)
    assert hub.requests == []
    monkeypatch.setenv("HF_TOKEN", "hf_" + secrets.token_urlsafe(24))
    with pytest.raises(HubError, match=r"refused the token \(401\); log in with `hf auth login`"):
        push(art_a, URL, progress=False)
    assert REPO not in hub.repos


def test_token_from_the_token_file(hub, art_a, token, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    (tmp_path / "hf-home").mkdir(exist_ok=True)
    (tmp_path / "hf-home" / "token").write_text(token)
    push(art_a, URL, private=True, progress=False)
    assert hub.repos[REPO].private
    # huggingface_hub itself fetches its agent-harness registry anonymously, at most once a day per
    # HF_HOME (a fresh one here): not one of the push's requests
    unauthorized = [
        (r.method, r.path, r.header("Authorization") is not None)
        for r in hub.requests
        if r.path.startswith("/api/")
        and r.path != "/api/agent-harnesses"
        and r.header("Authorization") != f"Bearer {token}"
    ]
    assert unauthorized == []
    # a private repo is not there for someone without the token
    (tmp_path / "hf-home" / "token").unlink()
    with pytest.raises(runtime_hub.HubError, match=r"no such model repo .* private"):
        runtime_hub.pull(URL, tmp_path / "anon", progress=False)
    assert leftovers(tmp_path, "anon") == []


# --- pull and load -------------------------------------------------------------------------------
def test_pull_to_a_directory_is_byte_identical(hub, art_a, tmp_path):
    push(art_a, URL, progress=False)
    out = runtime_hub.pull(URL, tmp_path / "pulled", progress=False)
    assert out == tmp_path / "pulled"
    assert artifact_files(out) == artifact_files(art_a)  # no .gitattributes, no .cache/ bookkeeping
    assert leftovers(tmp_path, "pulled") == ["pulled"]
    with pytest.raises(runtime_hub.HubError, match="already exists"):
        runtime_hub.pull(URL, out, progress=False)
    cached = runtime_hub.pull(URL, progress=False)  # into the cache (HF_HOME)
    assert cached.is_relative_to(tmp_path / "hf-home") and artifact_files(cached) == artifact_files(art_a)


@pytest.mark.parametrize("how", ["bytes flipped in storage", "replaced by a commit"])
def test_pull_of_a_corrupted_file_names_it_and_leaves_nothing(hub, art_a, tmp_path, how):
    push(art_a, URL, progress=False)
    victim = random.choice(sorted(json.loads((art_a / MANIFEST).read_text())["files"]))
    if how == "bytes flipped in storage":
        hub.corrupt(REPO, victim)
        reason = "sha256 does not match the manifest"
    else:
        hub.server_commit(REPO, "oops", add={victim: (art_a / victim).read_bytes() + b"\n"})
        reason = "size"
    with pytest.raises(runtime_hub.HubError, match=rf"{URL}: the downloaded artifact does not match its manifest:\n  {re.escape(victim)}: {reason}"):  # fmt: skip
        runtime_hub.pull(URL, tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == []
    with pytest.raises(runtime_hub.HubError, match=re.escape(victim)):  # through the cache: the same, every time
        runtime_hub.pull(URL, progress=False)
    with pytest.raises(runtime_hub.HubError, match=re.escape(victim)):
        qruntime.load(URL, "cpu", **SMALL_CACHE)


def test_load_by_name_generates_what_the_local_artifact_does(hub, art_a):
    push(art_a, URL, progress=False)
    prompt = [random.randrange(500) for _ in range(random.randint(3, 9))]
    params = qruntime.SamplingParams(max_tokens=12, ignore_eos=True)
    local = qruntime.load(art_a, "cpu", **SMALL_CACHE).generate(prompt, params)[0]
    engine = qruntime.load(URL, "cpu", **SMALL_CACHE)
    assert engine.description["artifact"] == URL
    assert engine.generate(prompt, params)[0].token_ids == local.token_ids


def test_pull_clis(hub, art_a, tmp_path, capsys):
    push(art_a, URL, progress=False)
    count = len(json.loads((art_a / MANIFEST).read_text())["files"])
    result = CliRunner().invoke(qcompile_main, ["pull", URL, "-o", str(tmp_path / "a"), "-q"])
    assert result.exit_code == 0, result.output
    assert result.output == f"ok: {count} files verified in {tmp_path / 'a'}\n"
    assert artifact_files(tmp_path / "a") == artifact_files(art_a)
    result = CliRunner().invoke(qcompile_main, ["pull", "hf://org", "-o", str(tmp_path / "b")])
    assert result.exit_code == 1 and "error: 'hf://org': expected hf://<namespace>/<name>" in result.output
    result = CliRunner().invoke(qcompile_main, ["pull", "hf://org/missing", "-o", str(tmp_path / "b"), "-q"])
    assert result.exit_code == 1 and "error: hf://org/missing: no such model repo" in result.output
    assert leftovers(tmp_path, "b") == []

    assert qruntime_main(["pull", URL, "-o", str(tmp_path / "c"), "--revision", "main", "-q"]) == 0
    assert capsys.readouterr().out == f"ok: {count} files verified in {tmp_path / 'c'}\n"
    assert qruntime_main(["pull", f"{URL}@main", "--revision", "other", "-q"]) == 1
    assert "disagree" in capsys.readouterr().err


def test_the_token_appears_nowhere(hub, art_a, art_b, token, tmp_path, caplog, capfd):
    """Push, re-push, a refused push, a forced one, pull, load: the token is in no log line, no output,
    no file under tmp (HF_HOME included), and no request but in its Authorization header."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="huggingface_hub")
    push(art_a, URL, progress=True)
    push(art_a, URL, dry_run=True, progress=True)
    with pytest.raises(HubError) as refused:
        push(art_b, URL, progress=True)
    push(art_b, URL, force=True, progress=True)
    runtime_hub.pull(URL, tmp_path / "pulled", progress=True)
    qruntime.load(URL, "cpu", **SMALL_CACHE)
    shard = next(p for p in json.loads((art_b / MANIFEST).read_text())["files"] if p.startswith("weights/"))
    hub.server_commit(REPO, "tamper", add={shard: secrets.token_bytes((art_b / shard).stat().st_size)})
    with pytest.raises(runtime_hub.HubError) as corrupted:
        runtime_hub.pull(URL, tmp_path / "bad", progress=True)

    assert len(caplog.records) > 10  # huggingface_hub logged its requests (HF_DEBUG: as curl commands)
    assert token not in caplog.text
    out, err = capfd.readouterr()
    assert token not in out and token not in err
    assert token not in str(refused.value) and token not in str(corrupted.value)
    files = list(files_under(tmp_path))
    assert any(p.is_relative_to(tmp_path / "hf-home") for p in files)
    assert [p for p in files if token.encode() in p.read_bytes() or token in str(p)] == []
    assert sha256_file(tmp_path / "pulled" / MANIFEST) == sha256_file(art_b / MANIFEST)
    # the hub fixture checks every request at teardown; here, that the token did travel where it should
    assert any(r.header("Authorization") == f"Bearer {token}" for r in hub.requests)


def test_git_blob_sha1_is_gits(tmp_path):
    data = secrets.token_bytes(random.randint(0, 5000))
    (tmp_path / "f").write_bytes(data)
    from hubserver import git_oid

    assert git_blob_sha1(tmp_path / "f") == git_oid(data)
    (tmp_path / "e").write_bytes(b"")
    assert git_blob_sha1(tmp_path / "e") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # git's empty blob
