"""Hub repos as sources and --push-to-hub, with the real huggingface_hub against a local stand-in of the hub.

There is no network here: ``LocalHub`` serves the few endpoints huggingface_hub calls (repo info, file tree,
file download; repo and branch creation, preupload and commit), so the hub cache is filled and the upload is
made by huggingface_hub's own code. Files are plain git blobs (the stand-in answers "regular" to preupload),
so the LFS and xet transfer paths of a real hub are not exercised.
"""

import base64
import hashlib
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from conftest import dcptool

TOKEN = "hf_local_test_token"


class LocalHub:
    """Model repos in memory: ``repos[id] = {"private": bool, "branches": {name: sha}, "commits": {sha: files}}``."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.requests: list[str] = []
        self.messages: list[str] = []  # commit summaries, in order
        handler = type("Handler", (_Handler,), {"hub": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add_repo(self, repo_id: str, folder: Path) -> str:
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        self.repos[repo_id] = {"private": False, "branches": {}, "commits": {}}
        return self.commit(repo_id, "main", files)

    def commit(self, repo_id: str, branch: str, files: dict[str, bytes]) -> str:
        repo = self.repos[repo_id]
        parent = repo["branches"].get(branch)
        tree = {**repo["commits"].get(parent, {}), **files}
        sha = hashlib.sha1(repr((parent, sorted((k, _blob_id(v)) for k, v in tree.items()))).encode()).hexdigest()
        repo["commits"][sha], repo["branches"][branch] = tree, sha
        return sha

    def files(self, repo_id: str, revision: str) -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return repo["commits"][repo["branches"].get(revision, revision)]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: LocalHub

    def log_message(self, *args):  # quiet: pytest shows failures, not the request log
        pass

    def do_GET(self):
        self._route("GET")

    def do_HEAD(self):
        self._route("HEAD")

    def do_POST(self):
        self._route("POST")

    def _route(self, method: str):
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append(f"{method} {path}")
        parts = path.strip("/").split("/")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else b""
        if parts[:2] == ["api", "repos"] and parts[2:] == ["create"]:
            return self._create_repo(json.loads(body))
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, action, rest = "/".join(parts[2:4]), (parts[4:5] or ["revision"])[0], parts[5:]
            if repo_id not in self.hub.repos:
                return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            return self._api(method, repo_id, action, rest or ["main"], body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(method, "/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        return self._error(404, None, f"no route {method} {path}")

    def _api(self, method, repo_id, action, rest, body):
        hub, repo = self.hub, self.hub.repos[repo_id]
        if method == "GET" and action in ("revision", "tree"):
            revision = rest[0]
            sha = repo["branches"].get(revision, revision if revision in repo["commits"] else None)
            if sha is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            files = repo["commits"][sha]
            if action == "tree":
                return self._json([{"type": "file", "oid": _blob_id(data), "size": len(data), "path": name}
                                   for name, data in files.items()])
            return self._json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": repo["private"],
                               "siblings": [{"rfilename": name} for name in files]})
        if not self._authorized():
            return
        if method == "POST" and action == "branch":
            if rest[0] in repo["branches"]:
                return self._error(409, None, "Reference already exists")
            repo["branches"][rest[0]] = repo["branches"]["main"]
            return self._json({})
        if method == "POST" and action == "preupload":
            names = [f["path"] for f in json.loads(body)["files"]]
            return self._json({"files": [{"path": n, "uploadMode": "regular", "shouldIgnore": False} for n in names]})
        if method == "POST" and action == "commit":
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            files = {v["path"]: base64.b64decode(v["content"]) for k, v in ((x["key"], x["value"]) for x in lines)
                     if k == "file"}
            header = next(x["value"] for x in lines if x["key"] == "header")
            hub.messages.append(header["summary"])
            sha = hub.commit(repo_id, rest[0], files)
            return self._json({"commitOid": sha, "commitUrl": f"{hub.endpoint}/{repo_id}/commit/{sha}"})
        return self._error(404, None, f"no route {method} {action}")

    def _create_repo(self, request):
        if not self._authorized():
            return
        repo_id = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
        if repo_id in self.hub.repos:  # the hub's answer names the repo too
            return self._error(409, None, "You already created this model repo", url=f"{self.hub.endpoint}/{repo_id}")
        private = request.get("visibility", "private" if request.get("private") else "public") == "private"
        self.hub.repos[repo_id] = {"private": private, "branches": {}, "commits": {}}
        self.hub.commit(repo_id, "main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"})
        return self._json({"url": f"{self.hub.endpoint}/{repo_id}", "name": repo_id})

    def _resolve(self, method, repo_id, revision, name):
        try:
            files = self.hub.files(repo_id, revision)
        except KeyError:
            return self._error(404, "RepoNotFound", f"{repo_id}@{revision} not found")
        if name not in files:
            return self._error(404, "EntryNotFound", f"{name} not found")
        data = files[name]
        repo = self.hub.repos[repo_id]
        self.send_response(200)
        self.send_header("X-Repo-Commit", repo["branches"].get(revision, revision))
        self.send_header("ETag", f'"{_blob_id(data)}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if method == "GET":
            self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {TOKEN}":
            return True
        self._error(401, None, "Invalid credentials in Authorization header")
        return False

    def _json(self, value, status=200):
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status, code, message, **fields):
        data = json.dumps({"error": message, **fields}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


# A tiny Llama model folder, served as org/tiny with files dcptool must not fetch beside it.
SKIPPED = {"README.md": b"# tiny\n", "original/consolidated.safetensors": b"not fetched", "pytorch_model.bin": b"x"}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 16,
         "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 4, "tie_word_embeddings": False, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import numpy as np
    from safetensors.numpy import save_file

    folder = tmp_path_factory.mktemp("tiny") / "tiny"
    folder.mkdir()
    shapes = {"model.embed_tokens.weight": [64, 16], "model.norm.weight": [16], "lm_head.weight": [64, 16]}
    for n in range(2):
        layer = f"model.layers.{n}"
        shapes |= {f"{layer}.input_layernorm.weight": [16], f"{layer}.post_attention_layernorm.weight": [16],
                   f"{layer}.self_attn.q_proj.weight": [16, 16], f"{layer}.self_attn.k_proj.weight": [8, 16],
                   f"{layer}.self_attn.v_proj.weight": [8, 16], f"{layer}.self_attn.o_proj.weight": [16, 16],
                   f"{layer}.mlp.gate_proj.weight": [32, 16], f"{layer}.mlp.up_proj.weight": [32, 16],
                   f"{layer}.mlp.down_proj.weight": [16, 32]}
    rng = np.random.default_rng(0)
    save_file({k: rng.standard_normal(shape, dtype=np.float32) for k, shape in shapes.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(LLAMA))
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return folder


@pytest.fixture(scope="module")
def local_hub(tiny_model):
    hub = LocalHub()
    hub.add_repo("org/tiny", tiny_model)
    hub.commit("org/tiny", "main", SKIPPED)
    yield hub
    hub.close()


@pytest.fixture
def hub_env(local_hub, tmp_path, monkeypatch):
    """The command line's environment: the local hub, an empty hub cache, no token, online; cwd a fresh folder."""
    monkeypatch.setenv("HF_ENDPOINT", local_hub.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def go_offline(monkeypatch):
    """HF_HUB_OFFLINE=1, and an endpoint where nothing listens: any request would fail, not reach the stand-in."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")


def error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_hub_repo_read_from_the_cache_offline(tiny_model, hub_env, monkeypatch):
    """Filled once by huggingface_hub's snapshot_download (only the files needed), then every command reads the
    repo id offline: inspect, convert, import-hf, verify and checksum, checked against the files themselves."""
    from safetensors.numpy import load_file

    from conftest import read_dcp

    original = load_file(tiny_model / "model.safetensors")
    online = dcptool("inspect", "org/tiny", "--json")
    assert set(json.loads(online.stdout)["tensors"]) == set(original)
    snapshots = list((hub_env / "hf-home/hub/models--org--tiny/snapshots").iterdir())
    assert len(snapshots) == 1 and (snapshots[0] / "model.safetensors").is_symlink()  # the cache's own layout
    fetched = sorted(p.name for p in snapshots[0].iterdir())
    assert fetched == ["config.json", "generation_config.json", "model.safetensors"]

    go_offline(monkeypatch)
    shown = json.loads(dcptool("inspect", "hf://org/tiny", "--json").stdout)
    assert {k: v["shape"] for k, v in shown["tensors"].items()} == {k: list(v.shape) for k, v in original.items()}

    dcptool("convert", "org/tiny", "as-dcp", "--to", "dcp", "--revision", "main")
    converted = read_dcp(hub_env / "as-dcp", hub_env)
    assert set(converted) == set(original)
    assert all((converted[k].numpy() == v).all() for k, v in original.items())

    dcptool("import-hf", "org/tiny", "imported", "--dp", "2")
    dcptool("export-hf", "org/tiny", "exported", "--revision", "main")  # --revision: the source's, as everywhere
    assert "equal: 21 tensors" in dcptool("verify", tiny_model, "exported").stdout
    imported = read_dcp(hub_env / "imported", hub_env)
    assert all((imported[k].numpy() == v).all() for k, v in original.items())

    assert "equal: 21 tensors" in dcptool("verify", tiny_model, "org/tiny").stdout
    dcptool("checksum", tiny_model, "--write", "--manifest", "tiny.json")
    against = dcptool("checksum", tiny_model, "--against", "org/tiny", "--manifest", "tiny.json")
    assert "21 tensors match" in against.stdout
    dcptool("checksum", "org/tiny", "--write", "--manifest", "hub.json")
    assert "intact" in dcptool("checksum", "org/tiny", "--check", "--manifest", "hub.json").stdout
    assert sorted(p.name for p in snapshots[0].iterdir()) == fetched  # nothing written into the cache

    (snapshots[0] / "model.safetensors").unlink()  # a download cut short: huggingface_hub's tree cache tells
    partial = dcptool("inspect", "org/tiny", check=False)
    assert partial.returncode == 2
    assert error_line(partial) == ("dcptool: error: org/tiny: the local hub cache holds only part of this model and "
                                   "HF_HUB_OFFLINE=1: run without it, or `hf download org/tiny`")


def test_hub_sources_refused_with_one_line(tiny_model, hub_env, monkeypatch):
    missing = dcptool("inspect", "org/missing", check=False)
    assert missing.returncode == 2
    assert "org/missing: no such local file or folder, and no model repo of that name on the hub" in error_line(missing)
    revision = dcptool("inspect", "org/tiny", "--revision", "no-such-branch", check=False)
    assert revision.returncode == 2 and "the hub has no revision 'no-such-branch'" in error_line(revision)
    twice = dcptool("inspect", "hf://org/tiny@main", "--revision", "v2", check=False)
    assert twice.returncode == 2 and "a revision is given twice" in error_line(twice)
    local = dcptool("inspect", tiny_model, "--revision", "main", check=False)
    assert local.returncode == 2 and "goes with a hub repo (ORG/NAME or hf://ORG/NAME)" in error_line(local)
    no_manifest = dcptool("checksum", "org/tiny", "--write", check=False)
    assert no_manifest.returncode == 2 and "give --manifest" in error_line(no_manifest)

    go_offline(monkeypatch)
    offline = dcptool("inspect", "org/tiny", check=False)
    assert offline.returncode == 2
    assert error_line(offline) == ("dcptool: error: org/tiny: no such local file or folder, and not in the local hub "
                                   "cache with HF_HUB_OFFLINE=1: run without it, or `hf download org/tiny` first")

    # A local folder always wins over a repo id of the same name, online or not.
    (hub_env / "org").mkdir()
    shutil.copytree(tiny_model, hub_env / "org/tiny")
    found = json.loads(dcptool("inspect", "org/tiny", "--json").stdout)
    assert found["info"]["hf_config_dir"] == "org/tiny"


def test_export_pushed_to_a_branch_and_read_back(hub_env, local_hub, tiny_model, monkeypatch):
    """create_repo (private), create_branch and upload_folder by huggingface_hub against the stand-in; the branch
    then holds the export's bytes, and reading it back through the hub gives the same tensors."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    dcptool("convert", tiny_model, "step-1", "--to", "dcp")
    pushed = dcptool("export-hf", "step-1", "hf-1", "--config-dir", tiny_model, "--push-to-hub", "org/run",
                     "--private", "--push-branch", "step-1", "--commit-message", "step 1 of run 7")
    assert f"pushed hf-1 to {local_hub.endpoint}/org/run/tree/step-1" in pushed.stdout
    repo = local_hub.repos["org/run"]
    assert repo["private"] and local_hub.messages[-1] == "step 1 of run 7"
    export = {p.name: p.read_bytes() for p in (hub_env / "hf-1").iterdir()}
    assert {k: v for k, v in local_hub.files("org/run", "step-1").items() if k != ".gitattributes"} == export

    dcptool("export-hf", "step-1", "hf-2", "--config-dir", tiny_model, "--push-to-hub", "org/run",
            "--push-branch", "step-2")
    assert set(repo["branches"]) == {"main", "step-1", "step-2"}  # the repo existed: a second branch beside it
    assert "equal: 21 tensors" in dcptool("verify", "hf-1", "hf://org/run@step-2").stdout


def test_push_failures_keep_the_export(hub_env, tiny_model, monkeypatch):
    dcptool("convert", tiny_model, "step-1", "--to", "dcp")
    no_token = dcptool("export-hf", "step-1", "out", "--push-to-hub", "org/run", check=False)
    assert no_token.returncode == 2 and "no Hugging Face token: log in with `hf auth login`" in error_line(no_token)
    assert not (hub_env / "out").exists()  # refused before the export started
    alone = dcptool("export-hf", "step-1", "out", "--private", check=False)
    assert alone.returncode == 2 and "go with --push-to-hub" in error_line(alone)
    bad_name = dcptool("export-hf", "step-1", "out", "--push-to-hub", "not a repo", check=False)
    assert bad_name.returncode == 2 and "give the repo as ORG/NAME" in error_line(bad_name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = dcptool("export-hf", "step-1", "out", "--push-to-hub", "org/run", check=False)
    assert offline.returncode == 2 and "HF_HUB_OFFLINE=1 is set: unset it" in error_line(offline)
    assert not (hub_env / "out").exists()
    monkeypatch.delenv("HF_HUB_OFFLINE")

    monkeypatch.setenv("HF_TOKEN", "hf_not_valid")
    refused = dcptool("export-hf", "step-1", "out", "--config-dir", tiny_model, "--push-to-hub", "org/run", check=False)
    assert refused.returncode == 2 and refused.stderr.count("dcptool: error:") == 1
    assert "the hub refused the upload (the token is not valid" in refused.stderr
    assert "the export stays in out" in refused.stderr and (hub_env / "out/model.safetensors").is_file()

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    unreachable = dcptool("export-hf", "step-1", "out-2", "--config-dir", tiny_model, "--push-to-hub", "org/run",
                          check=False)
    assert unreachable.returncode == 2
    assert "org/run: the hub at http://127.0.0.1:9 could not be reached" in unreachable.stderr
    assert (hub_env / "out-2/model.safetensors").is_file()


def test_cache_snapshot_reads_only_its_repos_blobs(tiny_model, tmp_path):
    """A snapshot's files may be links into its repo's blobs/ (as huggingface_hub makes them), nowhere else."""
    snapshot = tmp_path / "hub/models--org--evil/snapshots/0123abcd"
    snapshot.mkdir(parents=True)
    (tmp_path / "hub/models--org--evil/blobs").mkdir()
    (snapshot / "config.json").write_text(json.dumps(LLAMA))
    (snapshot / "model.safetensors").symlink_to(tiny_model / "model.safetensors")
    refused = dcptool("inspect", snapshot, check=False)
    assert refused.returncode == 2 and "names a file outside the checkpoint folder" in error_line(refused)
