"""Reading checkpoints from URLs through fsspec: the same answers, byte for byte, as from the local copy.

Real checkpoints (a gloo job's FSDP2 DCP and its conversions to every format) are copied into
fsspec's ``memory://`` filesystem. That filesystem lives in this process, so the commands run here
through ``dcptool.cli.main`` rather than as subprocesses. ``s3://`` is read from a real S3 API server
(moto's, a process of its own) through s3fs, by commands run as processes, as a user runs them.
"""

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import random
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import pytest

from dcptool import cli
from dcptool.storage import remote
from harness.conversions import convert_checkpoint
from dcptool.errors import CheckpointError
from dcptool.storage import CheckpointFiles

MEMORY = fsspec.filesystem("memory")
SOURCES = ["dcp", "torch", "hf", "hf-file", "fsdp1"]


def run(*args) -> tuple[int, str, str]:
    """``dcptool ARGS`` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def ok(*args) -> str:
    code, out, err = run(*args)
    assert code == 0, f"dcptool {' '.join(map(str, args))} exited {code}: {err}"
    return out


def refused(*args, names: str) -> str:
    """Exit 2 with one line on stderr that contains ``names``."""
    code, _, err = run("--quiet", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert names in lines[0], lines[0]
    return lines[0]


def memory_path(url: str) -> str:
    """The memory filesystem's path of a ``memory://`` URL."""
    return fsspec.core.url_to_fs(url)[1]


def upload(local: Path, url: str) -> str:
    """Copy a local file or folder to ``url`` in the memory filesystem."""
    target = memory_path(url)
    files = [local] if local.is_file() else [p for p in local.rglob("*") if p.is_file()]
    for item in files:
        name = target if local.is_file() else f"{target}/{item.relative_to(local).as_posix()}"
        MEMORY.pipe(name, item.read_bytes())
    return url


def digests(path: Path) -> dict[str, str]:
    """SHA-256 of each file under ``path`` (or of the file ``path``), by name."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def same_tree(a: Path, b: Path) -> None:
    """The same files with the same bytes (a file compared with a file)."""
    if a.is_file():
        assert a.read_bytes() == b.read_bytes()
        return
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def local(checkpoints, tmp_path_factory):
    """The gloo job's DCP checkpoint and its conversions, by format name."""
    dcp, _ = checkpoints("fsdp2_dp2")
    folder = tmp_path_factory.mktemp("remote-sources")
    made = {"dcp": dcp, "torch": folder / "full.pt", "hf": folder / "hf", "fsdp1": folder / "fsdp1"}
    convert_checkpoint(dcp, made["torch"], to="torch")
    convert_checkpoint(dcp, made["hf"], to="hf", writer_options={"max_shard_size": 20_000})  # shards and an index
    convert_checkpoint(dcp, made["fsdp1"], to="fsdp1", world_size=2)
    made["hf-file"] = made["hf"].parent / "single" / "model.safetensors"
    convert_checkpoint(made["hf"], made["hf-file"].parent, to="hf")
    assert len(list(made["hf"].glob("*.safetensors"))) > 1 and made["hf-file"].is_file()
    return made


@pytest.fixture
def bucket():
    """A fresh ``memory://`` folder, removed afterwards (the memory filesystem is shared by the whole process)."""
    url = f"memory://dcptool-test-{uuid.uuid4().hex[:8]}"
    yield url
    with contextlib.suppress(FileNotFoundError):
        MEMORY.rm(memory_path(url), recursive=True)


def remote_copy(local_path: Path, bucket: str) -> str:
    return upload(local_path, f"{bucket}/{local_path.name}")


@pytest.mark.parametrize("source", SOURCES)
def test_inspect_json_is_the_same(local, bucket, source):
    url = remote_copy(local[source], bucket)
    assert ok("inspect", url, "--json") == ok("inspect", local[source], "--json")
    assert "memory://" in ok("inspect", url)


@pytest.mark.parametrize("source", SOURCES)
def test_export_hf_writes_the_same_bytes(local, bucket, tmp_path, source):
    url = remote_copy(local[source], bucket)
    ok("--quiet", "export-hf", url, tmp_path / "from-url", "--max-shard-size", "30KB")
    ok("--quiet", "export-hf", local[source], tmp_path / "from-path", "--max-shard-size", "30KB")
    same_tree(tmp_path / "from-url", tmp_path / "from-path")


@pytest.mark.parametrize("command", [["convert", "--to", "torch"], ["convert", "--to", "dcp", "--dtype", "bfloat16"],
                                     ["reshard", "--dp", "1"], ["convert", "--to", "fsdp1", "--world-size", "3"]])
def test_convert_and_reshard_write_the_same_bytes(local, bucket, tmp_path, command):
    url = remote_copy(local["dcp"], bucket)
    name, *options = command
    ok("--quiet", name, url, tmp_path / "from-url", *options)
    ok("--quiet", name, local["dcp"], tmp_path / "from-path", *options)
    same_tree(tmp_path / "from-url", tmp_path / "from-path")


@pytest.mark.parametrize("source", SOURCES)
def test_verify_a_url_against_a_local_checkpoint(local, bucket, source):
    url = remote_copy(local[source], bucket)
    others = [local[source]] + ([local["torch"]] if source == "dcp" else [])  # its own copy; DCP against torch too
    for other in others:
        report = json.loads(ok("verify", url, other, "--json"))
        assert report["equal"] and report["tensors_compared"] > 0
    assert json.loads(ok("verify", url, "--roundtrip", "torch", "--json"))["equal"]


def test_verify_finds_a_changed_byte_in_remote_data(local, bucket):
    url = remote_copy(local["hf-file"], bucket)
    target = memory_path(url)
    data = bytearray(MEMORY.cat_file(target))
    data[-1] ^= 0xFF  # the last element of the last tensor
    MEMORY.pipe(target, bytes(data))
    code, out, _ = run("verify", url, local["hf-file"])
    assert code == 1 and "value" in out


@pytest.mark.parametrize("source", SOURCES)
def test_checksum_is_the_same(local, bucket, tmp_path, source):
    url = remote_copy(local[source], bucket)
    ok("--quiet", "checksum", url, "--write", "--manifest", tmp_path / "url.json")
    ok("--quiet", "checksum", local[source], "--write", "--manifest", tmp_path / "path.json")
    from_url, from_path = (json.loads((tmp_path / n).read_text()) for n in ("url.json", "path.json"))
    assert from_url["files"] and from_url["tensors"]
    assert (from_url["files"], from_url["tensors"]) == (from_path["files"], from_path["tensors"])
    ok("--quiet", "checksum", url, "--check", "--manifest", tmp_path / "path.json")
    ok("--quiet", "checksum", local["dcp"], "--against", url, "--manifest", tmp_path / "url.json",
       "--prefix", "auto", "--against-prefix", "auto")


def test_checksum_check_reads_the_manifest_beside_the_remote_checkpoint(local, bucket, tmp_path):
    url = remote_copy(local["dcp"], bucket)
    ok("--quiet", "checksum", local["dcp"], "--write", "--manifest", tmp_path / "m.json")
    upload(tmp_path / "m.json", f"{url}/dcptool.manifest.json")
    assert "intact" in ok("--quiet", "checksum", url, "--check")
    data_file = f"{memory_path(url)}/__1_0.distcp"
    data = bytearray(MEMORY.cat_file(data_file))
    data[len(data) // 2] ^= 0x01
    MEMORY.pipe(data_file, bytes(data))
    code, out, _ = run("--quiet", "checksum", url, "--check")
    assert code == 1 and "changed file" in out and "__1_0.distcp" in out


def test_file_urls_are_local_paths(local, tmp_path):
    for source in ("dcp", "hf-file"):
        url = f"file://{local[source].resolve()}"
        assert ok("inspect", url, "--json") == ok("inspect", local[source], "--json")
        ok("--quiet", "export-hf", url, tmp_path / f"{source}-url")
        ok("--quiet", "export-hf", local[source], tmp_path / f"{source}-path")
        same_tree(tmp_path / f"{source}-url", tmp_path / f"{source}-path")
    ok("--quiet", "convert", local["hf-file"], f"file://{tmp_path / 'out.pt'}", "--to", "torch")
    assert (tmp_path / "out.pt").is_file()


def test_missing_remote_checkpoint_or_file(local, bucket, tmp_path):
    refused("inspect", f"{bucket}/nothing-here", names=f"{bucket}/nothing-here: no such file or folder")
    refused("export-hf", f"{bucket}/nothing-here", tmp_path / "out", names=f"{bucket}/nothing-here")
    url = remote_copy(local["hf"], bucket)
    shard = sorted(MEMORY.find(memory_path(url)))[0]
    MEMORY.rm(shard)
    line = refused("inspect", url, names=f"{url}/model.safetensors.index.json: names")
    assert os.path.basename(shard) in line
    assert not (tmp_path / "out").exists()


def test_remote_dcp_without_metadata_is_refused(local, bucket):
    url = remote_copy(local["dcp"], bucket)
    MEMORY.rm(f"{memory_path(url)}/.metadata")
    refused("inspect", url, names=f"{url}/.metadata: missing")


def test_index_naming_a_file_outside_the_folder_is_refused(local, bucket):
    url = remote_copy(local["hf"], bucket)
    folder = memory_path(url)
    index = json.loads(MEMORY.cat_file(f"{folder}/model.safetensors.index.json"))
    first = sorted(set(index["weight_map"].values()))[0]
    for escape in (f"../{first}", f"sub/../../{first}", f"/{first}"):
        MEMORY.pipe(f"{os.path.dirname(folder)}/{first}", MEMORY.cat_file(f"{folder}/{first}"))  # a real file there
        key = next(k for k, v in index["weight_map"].items() if v == first)
        changed = {**index, "weight_map": {**index["weight_map"], key: escape}}
        MEMORY.pipe(f"{folder}/model.safetensors.index.json", json.dumps(changed).encode())
        line = refused("inspect", url, names="outside the checkpoint folder")
        assert repr(escape) in line


def test_names_are_confined_to_the_folder(bucket):
    MEMORY.pipe(f"{memory_path(bucket)}/a/b.bin", b"x")
    files = CheckpointFiles(bucket)
    assert files.path("a/../a/b.bin") == f"{bucket}/a/b.bin" and files.read_all("a/./b.bin") == b"x"
    for name in ("", ".", "..", "../x", "a/../../x", "/etc/passwd", "//x"):
        with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
            files.path(name)


def test_unknown_protocol_says_what_to_install():
    refused("inspect", "nosuchfs://bucket/ckpt", names="nosuchfs://bucket/ckpt: Protocol not known: nosuchfs")
    if importlib.util.find_spec("s3fs") is None:
        refused("inspect", "s3://bucket/step-100", names="s3://bucket/step-100: Install s3fs")


# Each command, and what replaces its output with --overwrite: another checkpoint (the same model trained further),
# written as other files where the command allows (fewer shards, fewer ranks), so that a file left over shows.
DESTINATIONS = [(["export-hf", "--max-shard-size", "30KB"], ["--max-shard-size", "60KB"]),
                (["convert", "--to", "torch"], []),
                (["reshard", "--dp", "3"], ["--dp", "1"]),
                (["convert", "--to", "fsdp1", "--world-size", "2"], ["--world-size", "1"])]


@pytest.mark.parametrize("command, replacing", DESTINATIONS, ids=[" ".join(c) for c, _ in DESTINATIONS])
def test_remote_destinations_get_the_same_bytes_with_the_index_last(local, checkpoints, bucket, tmp_path, monkeypatch,
                                                                    command, replacing):
    """Written locally, then uploaded; the file that completes the checkpoint goes up last. --overwrite replaces
    the remote output with another: read back, it is what the same command writes locally."""
    uploaded = []
    put_file = type(MEMORY).put_file
    monkeypatch.setattr(type(MEMORY), "put_file", lambda self, lpath, rpath, **kw: (
        uploaded.append(Path(rpath).name), put_file(self, lpath, rpath, **kw))[1])
    name, *options = command
    ok("--quiet", name, local["dcp"], f"{bucket}/out", *options)
    ok("--quiet", name, local["dcp"], tmp_path / "local", *options)
    MEMORY.get(memory_path(f"{bucket}/out"), str(tmp_path / "downloaded"), recursive=True)
    same_tree(tmp_path / "downloaded", tmp_path / "local")
    completes = {"export-hf": "model.safetensors.index.json", "reshard": ".metadata"}.get(name) or (
        "fsdp_config.json" if "fsdp1" in options else None)
    assert len(uploaded) == len(list((tmp_path / "local").rglob("*"))) or (tmp_path / "local").is_file()
    if completes:
        assert uploaded[-1] == completes, uploaded
    refused(name, local["dcp"], f"{bucket}/out", *options, names=f"{bucket}/out: already exists (pass --overwrite")
    trained_further, _ = checkpoints("dp2_step2")
    ok("--quiet", name, trained_further, f"{bucket}/out", *options, *replacing, "--overwrite")
    ok("--quiet", name, trained_further, tmp_path / "local-2", *options, *replacing)
    MEMORY.get(memory_path(f"{bucket}/out"), str(tmp_path / "downloaded-2"), recursive=True)
    same_tree(tmp_path / "downloaded-2", tmp_path / "local-2")
    assert digests(tmp_path / "downloaded-2") != digests(tmp_path / "local")  # the bytes changed, not only the exit code


# moto's S3 server in a process of its own, on a port the system chose; it serves until its stdin closes.
MOTO_SERVER = """
import sys
from moto.server import ThreadedMotoServer

server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3 API (moto's server) with a bucket ``checkpoints``: the environment that points s3fs at it, as
    a user points it at MinIO or any S3-compatible store (AWS_ENDPOINT_URL and credentials), and a boto3 client."""
    import boto3

    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "w") as output:
        server = subprocess.Popen([sys.executable, "-c", MOTO_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=output, text=True)
    try:
        port = server.stdout.readline().strip()
        assert port.isdigit(), log.read_text()
        env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="test",
                              aws_secret_access_key="test", region_name="us-east-1")
        client.create_bucket(Bucket="checkpoints")
        yield env, client
    finally:
        server.stdin.close()
        server.wait(timeout=60)


def s3_upload(client, local_path: Path, name: str) -> str:
    """``local_path`` (a file or a folder) put in the bucket under ``name``; its s3:// URL."""
    files = [local_path] if local_path.is_file() else sorted(p for p in local_path.rglob("*") if p.is_file())
    for item in files:
        key = name if local_path.is_file() else f"{name}/{item.relative_to(local_path).as_posix()}"
        client.upload_file(str(item), "checkpoints", key)
    return f"s3://checkpoints/{name}"


def test_s3_sources_read_as_the_local_copy(local, s3, tmp_path, monkeypatch):
    """inspect and export-hf of checkpoints in an S3 bucket, run as a user runs them (a process with
    AWS_ENDPOINT_URL set), give what they give of the local copy; ranged reads of every size are exact."""
    env, client = s3

    def command(*args) -> str:
        result = subprocess.run([sys.executable, "-m", "dcptool", "--quiet", *map(str, args)], capture_output=True,
                                text=True, env={**os.environ, **env})
        assert result.returncode == 0, result.stderr
        return result.stdout

    for source in ("dcp", "hf"):
        url = s3_upload(client, local[source], source)
        assert command("inspect", url, "--json") == command("inspect", local[source], "--json")
        command("export-hf", url, tmp_path / f"{source}-from-s3", "--max-shard-size", "30KB")
        command("export-hf", local[source], tmp_path / f"{source}-from-path", "--max-shard-size", "30KB")
        same_tree(tmp_path / f"{source}-from-s3", tmp_path / f"{source}-from-path")
    data = random.Random(0).randbytes(3 * remote.BLOCK + 5)
    client.put_object(Bucket="checkpoints", Key="bytes/blob", Body=data)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    files = CheckpointFiles("s3://checkpoints/bytes")
    for offset, size in ((0, 1), (7, 30), (remote.BLOCK - 3, 9), (1, remote.BLOCK), (5, 3 * remote.BLOCK)):
        assert files.read("blob", offset, size) == data[offset:offset + size], (offset, size)
    files.close()


def test_remote_manifest_and_load_check_are_refused(local, bucket):
    url = remote_copy(local["hf-file"], bucket)
    refused("checksum", url, "--write", names="writing to remote storage is not supported yet; give a local --manifest")
    refused("verify", url, "--load-on", "dp=2", names="--load-on")


def test_reads_from_many_threads_match_the_file(local, bucket):
    """The write engine reads from several threads: every range, small (block cache) or large, must be exact."""
    path = local["torch"]
    data = path.read_bytes()
    url = remote_copy(path, bucket)
    sizes = [1, 30, remote.BLOCK - 1, remote.BLOCK, remote.BLOCK + 7, 3 * remote.BLOCK]
    rng = random.Random(0)
    ranges = [(rng.randrange(len(data) - size), size) for size in sizes for _ in range(20) if size < len(data)]
    for files in (CheckpointFiles(path), CheckpointFiles(url)):
        name = files.single_file

        def read(span):
            offset, size = span
            return files.read(name, offset, size) == data[offset:offset + size]

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(read, ranges * 3))
        files.close()
    assert isinstance(CheckpointFiles(path).local_fd(path.name), int)
    assert CheckpointFiles(url).local_fd(path.name) is None


def test_no_fsspec_for_local_paths_and_no_torch_for_urls(local):
    """Local runs start without fsspec; reading from a URL still never imports torch."""
    script = f"""
import contextlib, io, sys
from pathlib import Path
from dcptool import cli

def main(*args):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.main(list(args))
        except SystemExit as exc:
            assert exc.code == 0, exc.code

main("inspect", {str(local['dcp'])!r}, "--json")
assert "fsspec" not in sys.modules
import fsspec
memory = fsspec.filesystem("memory")
for item in Path({str(local['dcp'])!r}).iterdir():
    memory.pipe("/ckpt/" + item.name, item.read_bytes())
main("inspect", "memory://ckpt", "--json")
main("verify", "memory://ckpt", {str(local['dcp'])!r})
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_config_folders_may_be_urls(checkpoints, local, bucket, tmp_path):
    """A remote verl folder's huggingface/ config is found and copied, as for a local one, and
    --config-dir may be a URL; tied embeddings drop lm_head.weight in both cases."""
    _, reference = checkpoints("fsdp2_dp2")
    config = json.loads((reference / "config.json").read_text()) | {"tie_word_embeddings": True}
    actor = remote_copy(local["fsdp1"], bucket)
    MEMORY.pipe(f"{memory_path(actor)}/huggingface/config.json", json.dumps(config).encode())
    MEMORY.pipe(f"{memory_path(actor)}/huggingface/tokenizer.json", b'{"version": "1.0"}')
    ok("--quiet", "export-hf", actor, tmp_path / "from-verl-folder")
    ok("--quiet", "export-hf", local["dcp"], tmp_path / "from-config-dir", "--config-dir", f"{actor}/huggingface")
    for out in (tmp_path / "from-verl-folder", tmp_path / "from-config-dir"):
        assert json.loads((out / "config.json").read_text()) == config | {"dtype": "float32", "torch_dtype": "float32"}
        assert (out / "tokenizer.json").read_bytes() == b'{"version": "1.0"}'
        tensors = json.loads(ok("inspect", out, "--json"))["tensors"]
        assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    refused("reshard", local["dcp"], tmp_path / "tp3", "--tp", "3", "--dp", "1", "--config-dir",
            f"{actor}/huggingface", names=f"{actor}/huggingface/config.json")
