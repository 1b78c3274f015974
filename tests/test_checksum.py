"""dcptool checksum: manifests of real checkpoints in every format, and a corpus of corruptions they must catch.

Each corruption is applied to a copy of a real checkpoint (saved by a gloo job, or derived from one with
dcptool's own commands) that has a manifest; ``checksum --check`` must exit 1 naming the file or tensor,
and ``verify`` against the untouched original must name the tensor (or exit 2 naming the file when the
copy can no longer be read).
"""

import json
import pickle
import shutil
import struct

import blake3
import pytest
import torch
import torch.distributed.checkpoint  # noqa: F401  (the classes .metadata pickles name)
from conftest import dcptool, load_reference
from safetensors.torch import load_file, save_file

from dcptool.selection import model_part
from dcptool.formats import open_checkpoint

UP = "layers.0.mlp.up_proj.weight"  # the tensor the corruptions aim at
MANIFEST = "dcptool.manifest.json"


@pytest.fixture(scope="module")
def pristine(checkpoints, tmp_path_factory):
    """One checkpoint per format, each with a manifest written by ``checksum --write``."""
    tp2, _ = checkpoints("fsdp2_dp2_tp2")
    dp2, _ = checkpoints("fsdp2_dp2")
    out = tmp_path_factory.mktemp("pristine")
    shutil.copytree(tp2, out / "dcp")
    dcptool("convert", tp2, out / "torch" / "full.pt", "--to", "torch")
    dcptool("export-hf", tp2, out / "hf", "--max-shard-size", "100KB")  # several shards and an index
    dcptool("convert", dp2, out / "fsdp1", "--to", "fsdp1", "--world-size", "2")
    paths = {"dcp": out / "dcp", "torch": out / "torch" / "full.pt", "hf": out / "hf", "fsdp1": out / "fsdp1"}
    assert len(list(paths["hf"].glob("*.safetensors"))) > 2
    for path in paths.values():
        dcptool("checksum", path, "--write")
    return paths


def copy_of(path, tmp_path):
    """A copy of a checkpoint with its manifest, at the same name in a fresh folder."""
    folder = path.parent if path.is_file() else path
    shutil.copytree(folder, tmp_path / folder.name)
    return tmp_path / folder.name / path.name if path.is_file() else tmp_path / folder.name


def target(path):
    """The targeted tensor's key and where one of its chunks lies: (key, file name, byte offset, byte length)."""
    checkpoint = open_checkpoint(path)
    key = next(k for k in checkpoint.tensors if k.endswith(UP))
    tensor = checkpoint.tensors[key]
    raw = checkpoint.raw_bytes(tensor, tensor.chunks[-1])
    checkpoint.files.close()
    return key, raw.file, raw.offset, raw.span


def run(*args):
    """A dcptool command with --json: (exit code, parsed report or None, stderr)."""
    result = dcptool(*args, "--json", check=False)
    return result.returncode, json.loads(result.stdout) if result.stdout.strip() else None, result.stderr


# Corruptions: each changes a copy in place and returns what checksum --check and verify must report.


def flip_byte(path, fmt):
    key, name, offset, length = target(path)
    file = (path.parent if path.is_file() else path) / name
    data = bytearray(file.read_bytes())
    data[offset + length // 2] ^= 0x40
    file.write_bytes(data)
    if fmt == "hf":  # safetensors stores no CRC-32: the values changed
        return {"check": {("changed file", name), ("changed values", key)}, "verify": {(key, "value")}}
    # the bytes of a torch.save record no longer match its CRC-32: the tensor cannot be read, verify refuses it
    return {"check": {("changed file", name), ("unreadable tensor", key)}, "verify_error": "CRC-32"}


def truncate_file(path, fmt):
    key, name, _, _ = target(path)
    file = (path.parent if path.is_file() else path) / name
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return {"check": {("truncated file", name)}, "verify_error": name}


def delete_file(path, fmt):
    key, name, _, _ = target(path)
    ((path.parent if path.is_file() else path) / name).unlink()
    return {"check": {("missing file", name)}, "verify_error": name}


def swap_chunks(path, fmt):
    """DCP: two chunk records of one tensor swap storage entries in .metadata. Other formats, which keep no
    chunk records apart from the data: the bytes of two same-sized tensors in one file trade places."""
    if fmt == "dcp":
        key = target(path)[0]
        metadata = pickle.loads((path / ".metadata").read_bytes())
        sizes = {tuple(c.offsets): tuple(c.sizes) for c in metadata.state_dict_metadata[key].chunks}
        records = [index for index in metadata.storage_data if index.fqn == key]
        first, second = next((a, b) for a in records for b in records
                             if a.offset != b.offset and sizes[tuple(a.offset)] == sizes[tuple(b.offset)])
        storage = metadata.storage_data
        storage[first], storage[second] = storage[second], storage[first]
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
        return {"check": {("changed file", ".metadata"), ("changed values", key)}, "verify": {(key, "value")}}
    checkpoint = open_checkpoint(path)
    key = target(path)[0]
    places = {}  # (file, byte length) -> [(tensor, byte offset)]
    for name, tensor in checkpoint.tensors.items():
        for chunk in tensor.chunks:
            raw = checkpoint.raw_bytes(tensor, chunk)
            places.setdefault((raw.file, raw.span), []).append((name, raw.offset))
    checkpoint.files.close()
    folder = path.parent if path.is_file() else path
    contents = {name: folder.joinpath(name).read_bytes() for name in {f for f, _ in places}}
    # Two different tensors of the same byte length in one file, with different bytes; the target's first.
    file_name, length, (name_a, offset_a), (name_b, offset_b) = next(
        (file_name, length, a, b)
        for (file_name, length), group in sorted(places.items(), key=lambda item: all(n != key for n, _ in item[1]))
        for a in group for b in group
        if a[0] != b[0] and contents[file_name][a[1]:a[1] + length] != contents[file_name][b[1]:b[1] + length])
    data = bytearray(contents[file_name])
    data[offset_a:offset_a + length], data[offset_b:offset_b + length] = (
        data[offset_b:offset_b + length], data[offset_a:offset_a + length])
    folder.joinpath(file_name).write_bytes(data)
    if fmt != "hf":  # torch.save storages no longer match their CRC-32s: neither tensor can be read
        return {"check": {("changed file", file_name), ("unreadable tensor", name_a), ("unreadable tensor", name_b)},
                "verify_error": "CRC-32"}
    return {"check": {("changed file", file_name), ("changed values", name_a), ("changed values", name_b)},
            "verify": {(name_a, "value"), (name_b, "value")}}


def change_dtype(path, fmt):
    key = target(path)[0]
    if fmt == "dcp":
        metadata = pickle.loads((path / ".metadata").read_bytes())
        metadata.state_dict_metadata[key].properties.dtype = torch.int32
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
    elif fmt == "hf":
        name = target(path)[1]
        _edit_safetensors_header(path / name, lambda header: header[key].update(dtype="I32"))
    else:
        _rewrite_state(path, fmt, key, lambda tensor: tensor.view(torch.int32))
    return {"check": {("changed dtype", key)}, "verify": {(key, "dtype")}}


def drop_key(path, fmt):
    key, name, _, _ = target(path)
    if fmt == "dcp":
        metadata = pickle.loads((path / ".metadata").read_bytes())
        del metadata.state_dict_metadata[key]
        metadata.planner_data.pop(key, None)
        for index in [i for i in metadata.storage_data if i.fqn == key]:
            del metadata.storage_data[index]
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
    elif fmt == "hf":
        tensors = load_file(path / name)
        del tensors[key]
        save_file(tensors, path / name, metadata={"format": "pt"})
        index = json.loads((path / "model.safetensors.index.json").read_text())
        del index["weight_map"][key]
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        _rewrite_state(path, fmt, key, None)
    return {"check": {("missing tensor", key)}, "verify": {(key, "missing")}}


def _edit_safetensors_header(file, edit):
    """Change a safetensors header in place, padded to its old length so that no data moves."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    edit(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= length
    file.write_bytes(data[:8] + encoded.ljust(length) + data[8 + length:])


def _rewrite_state(path, fmt, key, change):
    """Rewrite a torch file (or, for fsdp1, every rank file) with torch, the tensor at ``key`` changed or dropped."""
    if fmt == "torch":
        state, nested = torch.load(path, weights_only=True), open_checkpoint(path).tensors[key].path
    else:  # fsdp1: through a full state dict, and back to per-rank files with dcptool
        dcptool("convert", path, path.parent / "model.pt", "--to", "torch")
        state, nested = torch.load(path.parent / "model.pt", weights_only=True), (key,)
    parent = state
    for part in nested[:-1]:
        parent = parent[part]
    if change is None:
        del parent[nested[-1]]
    else:
        parent[nested[-1]] = change(parent[nested[-1]])
    if fmt == "torch":
        torch.save(state, path)
        return
    torch.save(state, path.parent / "changed.pt")
    dcptool("convert", path.parent / "changed.pt", path.parent / "rewritten", "--to", "fsdp1", "--world-size", "2")
    for file in (path.parent / "rewritten").glob("model_world_size_*"):
        shutil.copyfile(file, path / file.name)


CORRUPTIONS = [flip_byte, truncate_file, delete_file, swap_chunks, change_dtype, drop_key]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("fmt", ["dcp", "torch", "hf", "fsdp1"])
def test_corruption_is_caught(pristine, tmp_path, fmt, corrupt):
    original = pristine[fmt]
    copy = copy_of(original, tmp_path)
    assert run("checksum", copy, "--check")[0] == 0
    expected = corrupt(copy, fmt)

    code, report, stderr = run("checksum", copy, "--check")
    assert code == 1, stderr
    found = {(p["kind"], p["name"]) for p in report["problems"]}
    assert expected["check"] <= found, found
    assert {p for p in found if p[0] == "changed values"} <= expected["check"], "an untouched tensor was reported"
    assert "problems against" in stderr and len(stderr.strip().splitlines()) == 1

    code, report, stderr = run("verify", original, copy)
    if "verify_error" in expected:
        assert code == 2 and expected["verify_error"] in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    else:
        assert code == 1, stderr
        assert {(d["key"], d["kind"]) for d in report["differences"]} == expected["verify"]


def test_manifest_records_every_file_but_itself(pristine):
    for fmt, path in pristine.items():
        folder = path.parent if path.is_file() else path
        manifest_file = folder / (f"{path.name}.{MANIFEST}" if path.is_file() else MANIFEST)
        manifest = json.loads(manifest_file.read_text())
        on_disk = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file() and p != manifest_file}
        assert set(manifest["files"]) == set(on_disk), fmt
        for name, entry in manifest["files"].items():
            assert entry == {"bytes": on_disk[name].stat().st_size, "hash": blake3.blake3(on_disk[name].read_bytes()).hexdigest()}
        assert manifest["format"] == fmt and manifest["hash"] == "blake3"


def test_tensor_hashes_are_of_global_values_in_any_layout(pristine, checkpoints):
    """Every tensor's hash is BLAKE3 of its row-major bytes, as torch gathered them in the job itself."""
    _, reference = checkpoints("fsdp2_dp2_tp2")
    full = load_reference(reference)
    for fmt in ("dcp", "torch", "hf"):
        path = pristine[fmt]
        manifest_file = path.parent / f"{path.name}.{MANIFEST}" if path.is_file() else path / MANIFEST
        tensors = json.loads(manifest_file.read_text())["tensors"]
        names = {k: k if fmt != "hf" else f"dcp.model.{k}" for k in tensors}
        assert len(tensors) == (len(full) if fmt != "hf" else sum(k.startswith("dcp.model.") for k in full))
        for key, entry in tensors.items():
            value = full[names[key]].contiguous()
            assert entry["hash"] == blake3.blake3(value.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest(), key
            assert (entry["dtype"], entry["shape"]) == (str(value.dtype).removeprefix("torch."), list(value.shape))


def test_against_other_formats_and_layouts(pristine, checkpoints, tmp_path):
    dcp = pristine["dcp"]
    assert run("checksum", dcp, "--against", pristine["torch"])[0] == 0
    code, report, stderr = run("checksum", dcp, "--against", pristine["hf"], "--prefix", "dcp.model")
    assert code == 0, stderr
    assert report["compared"] == report["tensors"] == len(open_checkpoint(pristine["hf"]).tensors)
    # Without the prefix nothing lines up, and the hint says what to do.
    result = dcptool("checksum", dcp, "--against", pristine["hf"], check=False)
    assert result.returncode == 1 and "--prefix" in result.stdout

    # A manifest kept outside the checkpoint; another world size and format (fsdp1 carries the
    # optimizer state too, so every tensor is compared); the model part found by itself.
    dp2, _ = checkpoints("fsdp2_dp2")
    dcptool("checksum", dp2, "--write", "--manifest", tmp_path / "dp2.json")
    assert not (dp2 / MANIFEST).exists()
    dcptool("convert", dp2, tmp_path / "fsdp1-3", "--to", "fsdp1", "--world-size", "3")
    code, report, stderr = run("checksum", dp2, "--against", tmp_path / "fsdp1-3", "--manifest", tmp_path / "dp2.json")
    assert code == 0, stderr
    assert report["compared"] == report["tensors"] == len(open_checkpoint(dp2).tensors)
    code, report, stderr = run("checksum", dp2, "--against", tmp_path / "fsdp1-3", "--manifest", tmp_path / "dp2.json",
                               "--prefix", "auto", "--against-prefix", "auto")
    assert code == 0, stderr
    assert report["compared"] == len(model_part(open_checkpoint(dp2)))

    flipped = copy_of(pristine["torch"], tmp_path)
    key = next(name for kind, name in flip_byte(flipped, "torch")["check"] if kind == "unreadable tensor")
    code, report, _ = run("checksum", dcp, "--against", flipped)  # its record's CRC-32 no longer matches
    assert code == 1 and [(p["kind"], p["name"]) for p in report["problems"]] == [("unreadable tensor", key)]


def test_scan_nonfinite(pristine, tmp_path):
    state = torch.load(pristine["torch"], weights_only=True)
    key = next(k for k in state["dcp"]["model"] if k.endswith(UP))
    weight = state["dcp"]["model"][key]
    weight[0, 0], weight[1, 1], weight[2, 2] = float("nan"), float("nan"), float("-inf")
    state["halves"] = torch.tensor([float("nan"), float("inf"), 1.0], dtype=torch.bfloat16)
    state["steps"] = torch.tensor([1, 2, 3])
    torch.save(state, tmp_path / "nan.pt")

    assert run("checksum", pristine["torch"], "--check", "--scan-nonfinite")[0] == 0
    code, report, stderr = run("checksum", tmp_path / "nan.pt", "--write", "--scan-nonfinite")
    assert code == 1 and "the manifest was written" in stderr
    assert {(p["name"], p["detail"]) for p in report["problems"]} == {
        (f"dcp.model.{key}", "2 NaN, 1 Inf"), ("halves", "1 NaN, 1 Inf")}
    manifest = json.loads((tmp_path / f"nan.pt.{MANIFEST}").read_text())
    assert (manifest["tensors"]["halves"]["nan"], manifest["tensors"]["halves"]["inf"]) == (1, 1)
    assert "nan" not in manifest["tensors"]["steps"]  # integers are not scanned
    code, report, _ = run("checksum", tmp_path / "nan.pt", "--check", "--scan-nonfinite")
    assert code == 1 and {p["kind"] for p in report["problems"]} == {"non-finite"}


def test_json_report_shape(pristine, tmp_path):
    copy = copy_of(pristine["dcp"], tmp_path)
    (copy / "notes.txt").write_text("not part of the checkpoint")
    code, report, _ = run("checksum", copy, "--check")
    assert code == 1
    assert set(report) == {"action", "path", "manifest", "files", "tensors", "compared", "bytes_hashed", "seconds",
                           "ok", "problems"}
    assert report["action"] == "check" and report["ok"] is False
    assert report["problems"] == [{"kind": "extra file", "name": "notes.txt", "detail": "on disk, not in the manifest"}]
    assert report["files"] == len(json.loads((copy / MANIFEST).read_text())["files"])


def test_write_is_atomic_and_touches_nothing_else(pristine, tmp_path):
    copy = copy_of(pristine["hf"], tmp_path)
    before = {p: p.read_bytes() for p in copy.iterdir()}
    result = dcptool("checksum", copy, "--write", check=False)
    assert result.returncode == 2 and "--overwrite" in result.stderr
    assert {p: p.read_bytes() for p in copy.iterdir()} == before
    dcptool("checksum", copy, "--write", "--overwrite")
    after = {p: p.read_bytes() for p in copy.iterdir()}
    assert after.keys() == before.keys()  # no temporary file left behind
    assert {p: v for p, v in after.items() if p.name != MANIFEST} == {p: v for p, v in before.items() if p.name != MANIFEST}
    assert run("checksum", copy, "--check")[0] == 0


def test_bad_manifest_or_arguments_exit_2(pristine, tmp_path):
    copy = copy_of(pristine["dcp"], tmp_path)
    (copy / MANIFEST).write_text("{not json")
    result = dcptool("checksum", copy, "--check", check=False)
    assert result.returncode == 2 and MANIFEST in result.stderr and len(result.stderr.strip().splitlines()) == 1
    (copy / MANIFEST).unlink()
    result = dcptool("checksum", copy, "--check", check=False)
    assert result.returncode == 2 and "no manifest" in result.stderr
    result = dcptool("checksum", copy, "--check", "--write", check=False)
    assert result.returncode == 2 and "choose one" in result.stderr
    result = dcptool("checksum", tmp_path / "nothing-here", "--check", check=False)
    assert result.returncode == 2 and "nothing-here" in result.stderr


def test_help_states_the_manifest_name_and_thread_cap():
    # dcptool/cli/checksum.py writes them out so that the other commands start without importing checksum (and blake3)
    import os
    import subprocess
    import sys

    from dcptool.checks import checksums

    help_text = subprocess.run([sys.executable, "-m", "dcptool", "checksum", "--help"], capture_output=True, text=True,
                               env={**os.environ, "COLUMNS": "300"}, check=True).stdout  # one line per option
    assert f"default: {checksums.MANIFEST_NAME} in the folder" in help_text
    assert f"at most {checksums.MAX_THREADS})" in help_text


def test_hashing_streams_within_the_memory_budget(tmp_path):
    """~200 MB of weights (as HF safetensors and as the 4-rank DCP checkpoint import-hf makes) hashed with 16 MiB."""
    import subprocess
    import sys

    import numpy as np
    from safetensors.numpy import save_file as save_numpy

    rng = np.random.default_rng(0)
    (tmp_path / "hf").mkdir()
    save_numpy({f"layers.{i}.weight": rng.standard_normal((2048, 3072), dtype=np.float32) for i in range(8)},
               str(tmp_path / "hf" / "model.safetensors"))
    dcptool("import-hf", tmp_path / "hf", tmp_path / "dcp", "--dp", "4")
    budget_mb = 16
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")

    def peak_mb(*args):
        result = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "dcptool", "--quiet", *map(str, args)],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return int(result.stdout.strip().splitlines()[-1]) / 1024

    baseline = peak_mb("inspect", tmp_path / "dcp", "--json")
    for command in (["--write"], ["--check", "--scan-nonfinite"], ["--against", tmp_path / "hf"]):
        peak = peak_mb("checksum", tmp_path / "dcp", *command, "--max-memory", f"{budget_mb}MiB", "--threads", "4")
        assert peak - baseline < budget_mb + 24, (command, peak, baseline)
