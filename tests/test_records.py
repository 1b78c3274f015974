"""Damaged records, found where dcptool reads them: every kind of damage to a real gloo-saved DCP checkpoint's
tensor and object records, to torch.save and FSDP1 files, and to the layout of safetensors files (HF and
torch's HF-storage DCP), made with independent code (python's zipfile locates the records' parts; the
safetensors header is rewritten as JSON).

For each damaged copy: torch's own loader fails on it, except where torch does not look (it does not check
CRC-32s: a damaged CRC field loads, and damaged storage bytes load as wrong values, silently); dcptool's
``check`` exits 1 naming the record, and ``verify``, ``convert``, ``reshard`` and ``export-hf`` exit 2 with one
line naming the file and the record, and write nothing.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import dcptool

KINDS = ["zip64 end record", "central directory", "local header", "CRC field", "data bytes"]
# torch's loader reads a record's zip structure but not its CRC-32s (miniz is built without the check):
# these damages load, a storage's damaged bytes as wrong values.
TORCH_DOES_NOT_SEE = {"CRC field", "data bytes"}


def damage_at(record: bytes, kind: str) -> int:
    """The offset in a torch.save archive (``record``) of a byte that damages ``kind``, found with python's zipfile:
    the entry damaged is the first storage (``data/0``), or data.pkl in an archive without storages."""
    archive = zipfile.ZipFile(io.BytesIO(record))
    infos = archive.infolist()
    entry = next((i for i in infos if i.filename.endswith("/data/0")), None) or \
        next(i for i in infos if i.filename.endswith("data.pkl"))
    name_length, extra_length = struct.unpack_from("<HH", record, entry.header_offset + 26)
    data = entry.header_offset + 30 + name_length + extra_length
    position = archive.start_dir  # the entry's central directory header: its CRC-32 is 16 bytes in
    while record[position + 46:position + 46 + struct.unpack_from("<H", record, position + 28)[0]] != \
            entry.filename.encode():
        position += 46 + sum(struct.unpack_from("<HHH", record, position + 28))
    return {"zip64 end record": record.rfind(b"PK\x06\x06") + 32,  # its count of entries on this disk
            "central directory": archive.start_dir,  # the first entry's signature
            "local header": entry.header_offset,  # its signature
            "CRC field": position + 16,
            "data bytes": data + entry.file_size // 2}[kind]


def flip(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01
    file.write_bytes(bytes(data))


def copy_with_damaged_data(source: Path, copy: Path, key: str) -> str:
    """``source`` (a DCP folder) copied to ``copy`` with one data byte of ``key``'s first record flipped (torch
    still loads it); returns the record's file name."""
    from torch.distributed.checkpoint import FileSystemReader

    info = next(info for index, info in FileSystemReader(str(source)).read_metadata().storage_data.items()
                if index.fqn == key)
    shutil.copytree(source, copy)
    record = (copy / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    flip(copy / info.relative_path, info.offset + damage_at(record, "data bytes"))
    return info.relative_path


def refused(argv: list, out: Path, *names: str, code: int = 2) -> str:
    """The command exits ``code`` with one line naming ``names`` on stderr, and ``out`` is not written."""
    result = dcptool(*argv, check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert not out.exists() and not [p for p in out.parent.iterdir() if "dcptool-tmp" in p.name]
    return lines[0]


def checked(path: Path, *names: str) -> dict:
    """``check --json`` exits 1, every name among its problems' lines."""
    result = dcptool("check", path, "--json", check=False)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    text = "\n".join(p["detail"] for p in report["problems"])
    for name in names:
        assert name in text, (name, text)
    return report


# DCP, saved by a real 2-rank gloo job (torchtitan layout: model weights, optimizer state, lr_scheduler and
# train_state as non-tensor records).


@pytest.fixture(scope="module")
def gloo_dcp(checkpoints):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path, _ = checkpoints("fsdp2_dp2")
    metadata = FileSystemReader(str(path)).read_metadata()
    weight = next(key for key, entry in metadata.state_dict_metadata.items()
                  if not isinstance(entry, BytesStorageMetadata) and not key.startswith("optimizer.")
                  and key.endswith(".weight") and len(entry.size) == 2)
    obj = next(key for key, entry in metadata.state_dict_metadata.items()  # carried by every command (per-rank
               if isinstance(entry, BytesStorageMetadata) and not key.startswith("dataloader."))  # state is not)
    records = {}
    for index, info in metadata.storage_data.items():
        records.setdefault(index.fqn, (info.relative_path, info.offset, info.length))
    return path, {"tensor": (weight, records[weight]), "object": (obj, records[obj])}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("entry", ["tensor", "object"])
def test_a_damaged_dcp_record_is_refused_where_it_is_read(gloo_dcp, tmp_path, entry, kind):
    source, records = gloo_dcp
    key, (name, offset, length) = records[entry]
    copy = tmp_path / "damaged"
    shutil.copytree(source, copy)
    flip(copy / name, offset + damage_at((copy / name).read_bytes()[offset:offset + length], kind))

    if kind not in TORCH_DOES_NOT_SEE:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with pytest.raises(BaseException):  # noqa: B017 - torch's CheckpointException wraps its reader's error
            dcp_to_torch_save(copy, tmp_path / "torch.pt")
    checked(copy, name, key)
    out = tmp_path / "out"
    refused(["verify", copy, source], out, name, key)
    refused(["convert", copy, out, "--to", "torch", "--no-fsync"], out, name, key)
    refused(["reshard", copy, out, "--dp", "1", "--no-fsync"], out, name, key)
    if entry == "tensor":  # an HF export holds the model weights only: a damaged object is not read
        refused(["export-hf", copy, out, "--no-fsync"], out, name, key)
    # a user who accepts the risk reads the damaged structure where it can still be read, the bytes as they are
    if kind in TORCH_DOES_NOT_SEE:
        assert dcptool("convert", copy, out, "--to", "torch", "--no-fsync", "--no-verify-records").returncode == 0


def test_a_damaged_record_read_as_column_blocks_is_refused(checkpoints, tmp_path):
    """reshard --tp 2 of an FSDP checkpoint cuts o_proj (TP's row-wise weight) into column blocks narrower than
    its chunks: each block's rows are checksummed whole as they are read, and a damaged byte is still found."""
    source, reference = checkpoints("fsdp2_dp2")
    key = "model.layers.0.self_attn.o_proj.weight"
    copy = tmp_path / "damaged"
    name = copy_with_damaged_data(source, copy, key)
    out = tmp_path / "out"
    line = refused(["reshard", copy, out, "--tp", "2", "--config-dir", reference, "--no-fsync"], out, name, key)
    assert "CRC-32" in line
    dcptool("reshard", source, out, "--tp", "2", "--config-dir", reference, "--no-fsync")
    assert json.loads(dcptool("check", out, "--json").stdout)["ok"]


def test_check_names_every_damaged_record_folded_by_layer(gloo_dcp, tmp_path):
    """Both chunk records of both layers' up_proj damaged: four problems, one line (--all: four)."""
    from torch.distributed.checkpoint import FileSystemReader

    source, _ = gloo_dcp
    copy = tmp_path / "damaged"
    shutil.copytree(source, copy)
    keys = [f"model.layers.{n}.mlp.up_proj.weight" for n in (0, 1)]
    for index, info in FileSystemReader(str(source)).read_metadata().storage_data.items():
        if index.fqn in keys:
            record = (copy / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
            flip(copy / info.relative_path, info.offset + damage_at(record, "data bytes"))
    result = dcptool("check", copy, check=False)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 3, result.stdout
    assert lines[1].startswith("record") and "model.layers.{0..1}.mlp.up_proj.weight: 4 problems" in lines[1]
    assert "4 problems (4 record)" in lines[2] and "4 problems" in result.stderr
    every = dcptool("check", copy, "--all", check=False).stdout.strip().splitlines()
    assert len(every) == 6 and all(any(key in line for key in keys) for line in every[1:5])
    report = checked(copy, *keys)
    assert [p["kind"] for p in report["problems"]] == ["record"] * 4


def test_records_of_an_intact_checkpoint_pass_and_are_checked_as_copied(gloo_dcp, tmp_path):
    """check says fine; a reshard copies every record's bytes and checks them as they pass (no second read)."""
    source, _ = gloo_dcp
    result = dcptool("check", source, "--json")
    report = json.loads(result.stdout)
    assert report["ok"] and report["records"] > report["tensors"] > 0 and report["objects"] > 0
    dcptool("reshard", source, tmp_path / "dp1", "--dp", "1", "--no-fsync")
    assert json.loads(dcptool("check", tmp_path / "dp1", "--json").stdout)["ok"]


def test_check_holds_a_config_beside_the_checkpoint_against_its_weights(checkpoints, tmp_path):
    """The job's own HF config fits its weights; one that says another intermediate size is named."""
    source, reference = checkpoints("fsdp2_dp2")
    copy = tmp_path / "with-config"
    shutil.copytree(source, copy)
    config = json.loads((reference / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config))
    report = json.loads(dcptool("check", copy, "--json").stdout)
    assert report["ok"] and report["config"].endswith("config.json")
    (copy / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 2}))
    report = checked(copy, "config.json", "mlp")
    assert [p["kind"] for p in report["problems"]] == ["config"]


# torch.save and FSDP1 files: one archive per file, each tensor a storage of it.


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_torch_save_file_is_refused(bases, tmp_path, kind):
    source = bases / "torch" / "full.pt"
    copy = tmp_path / "full.pt"
    shutil.copyfile(source, copy)
    flip(copy, damage_at(copy.read_bytes(), kind))
    if kind not in TORCH_DOES_NOT_SEE:
        with pytest.raises(BaseException):  # noqa: B017 - torch raises RuntimeError or an UnpicklingError
            torch.load(copy, weights_only=True)
    # the storage damaged is data/0, model.w's: its bytes are found damaged where model.w is read; damage to
    # the file's zip structure (a CRC field included) is found as it is opened, and named by the entry and, where
    # the pickle can still be read (not after damage to the directory or end records), the tensor it holds
    names = {"data bytes": ("full.pt", "model.w"), "CRC field": ("full.pt", "'full/data/0' (model.w)"),
             "local header": ("full.pt", "'full/data/0' (model.w)")}.get(kind, ("full.pt",))
    checked(copy, *names)
    out = tmp_path / "out"
    refused(["verify", copy, source], out, *names)
    refused(["convert", copy, out, "--to", "dcp", "--no-fsync"], out, *names)
    refused(["reshard", copy, out, "--dp", "2", "--no-fsync"], out, *names)


@pytest.mark.parametrize("kind", ["central directory", "data bytes"])
def test_a_damaged_fsdp1_rank_file_is_refused(bases, tmp_path, kind):
    copy = tmp_path / "fsdp1"
    shutil.copytree(bases / "fsdp1", copy)
    target = copy / "model_world_size_2_rank_1.pt"
    flip(target, damage_at(target.read_bytes(), kind))
    if kind not in TORCH_DOES_NOT_SEE:
        with pytest.raises(BaseException):  # noqa: B017
            torch.load(target, weights_only=False)
    checked(copy, target.name)
    out = tmp_path / "out"
    refused(["convert", copy, out, "--to", "torch", "--no-fsync"], out, target.name)
    refused(["verify", copy, bases / "fsdp1"], out, target.name)


# safetensors stores no CRC-32: its layout is checked as safetensors' own loader checks it.


def rewrite_safetensors(file: Path, gap: int = 0, trailing: int = 0) -> None:
    """Every tensor's data moved ``gap`` bytes further (a gap before the first), ``trailing`` bytes appended."""
    data = file.read_bytes()
    (length,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + length])
    for name, entry in header.items():
        if name != "__metadata__":
            entry["data_offsets"] = [offset + gap for offset in entry["data_offsets"]]
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * gap + data[8 + length:] + b"\0" * trailing)


@pytest.mark.parametrize("damage", [{"gap": 8}, {"trailing": 8}], ids=["gap", "trailing bytes"])
@pytest.mark.parametrize("fmt", ["hf", "hf-dcp"])
def test_safetensors_laid_out_as_its_loader_refuses_are_refused(bases, tmp_path, fmt, damage):
    from safetensors.torch import load_file

    copy = tmp_path / fmt
    shutil.copytree(bases / fmt, copy)
    target = min(copy.glob("*.safetensors"))
    rewrite_safetensors(target, **damage)
    with pytest.raises(Exception):  # noqa: B017 - safetensors' SafetensorError (torch's HF storage reader reads so)
        load_file(target)
    checked(copy, target.name)
    out = tmp_path / "out"
    refused(["convert", copy, out, "--to", "torch", "--no-fsync"], out, target.name)
    refused(["verify", copy, bases / fmt], out, target.name)


@pytest.mark.parametrize("fmt", ["hf", "hf2"])
def test_check_says_a_flipped_byte_of_safetensors_values_is_not_checked(bases, tmp_path, fmt):
    """safetensors stores no checksum: a flipped data byte loads (as another value), and check says that
    values were not checked, in its text and in --json; records that carry a CRC-32 need no such line."""
    from safetensors.torch import load_file

    copy = tmp_path / fmt
    shutil.copytree(bases / fmt, copy)
    target = min(copy.glob("*.safetensors"))
    key, before = next((key, value.clone()) for key, value in load_file(target).items())
    (length,) = struct.unpack_from("<Q", target.read_bytes())
    start, _ = json.loads(target.read_bytes()[8:8 + length])[key]["data_offsets"]
    flip(target, 8 + length + start)
    assert not torch.equal(load_file(target)[key], before)  # safetensors' own loader loads it
    result = dcptool("check", copy)
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.endswith("values not checked: the format stores no checksum; "
                            "use `dcptool checksum --write` for a manifest"), summary
    report = json.loads(dcptool("check", copy, "--json").stdout)
    assert report["ok"] and report["values_not_checked"] == {
        "tensors": report["tensors"], "why": "the format stores no checksum; use `dcptool checksum --write` for a manifest"}
    for intact in (bases / "torch" / "full.pt", bases / "fsdp1"):
        assert json.loads(dcptool("check", intact, "--json").stdout)["values_not_checked"] is None
    assert "not checked" not in dcptool("check", bases / "torch" / "full.pt").stdout


def test_an_index_that_disagrees_with_its_shards_is_named(bases, tmp_path):
    copy = tmp_path / "hf2"
    shutil.copytree(bases / "hf2", copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    index["weight_map"]["a"] = "model-00002-of-00002.safetensors"
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    report = checked(copy, "lists a in model-00002", "lists ghost")
    assert {p["kind"] for p in report["problems"]} == {"index"} and len(report["problems"]) == 2


def test_check_of_a_path_that_is_no_checkpoint_exits_2(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = dcptool("check", tmp_path / "notes.txt", check=False)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_check_names_every_entry_the_metadata_gets_wrong(gloo_dcp, tmp_path):
    """Two independent problems in a real job's .metadata (torch's own, unpickled and pickled again): a tensor
    with a chunk left out (a gap in its cover) and another whose record lies past its file's end. Both are
    named, each under its kind; every other entry is still checked; opening it for a copy stops at the first."""
    import dataclasses
    import pickle

    source, _ = gloo_dcp
    copy = tmp_path / "two-problems"
    shutil.copytree(source, copy)
    metadata = pickle.loads((copy / ".metadata").read_bytes())
    gap, past = [key for key, entry in metadata.state_dict_metadata.items()
                 if key.endswith("up_proj.weight") and len(getattr(entry, "chunks", ())) > 1][:2]
    metadata.state_dict_metadata[gap].chunks.pop()
    for index, info in metadata.storage_data.items():
        if index.fqn == past:
            metadata.storage_data[index] = dataclasses.replace(info, offset=info.offset + 2**30)
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))

    report = checked(copy, f"{gap}: chunks cover", f"truncated: {past} needs bytes")
    assert [(p["kind"], p["name"]) for p in report["problems"]] == [("metadata", past), ("cover", gap)]
    assert report["tensors"] == len(metadata.state_dict_metadata) - report["objects"] - 2 and report["records"] > 0
    out = tmp_path / "out"
    refused(["convert", copy, out, "--to", "torch", "--no-fsync"], out, past)


def test_a_reader_done_with_one_tensor_finishes_only_its_records(tmp_path):
    """Slab readers on several threads (verify, inspect --stats) each finish the records of their own tensor: a
    record another thread is still reading is not read again to check it (for zstd, decompressed again)."""
    from zlib_ng.zlib_ng import crc32

    from dcptool.storage import CheckpointFiles
    from dcptool.torch_archive import Archive
    from dcptool.torch_archive.records import RecordChecks

    torch.save({"a": torch.arange(64.0), "b": torch.arange(64.0) * 2}, tmp_path / "two.pt")
    files = CheckpointFiles(tmp_path / "two.pt")
    a, b = sorted(Archive(files, files.single_file).storage_data(), key=lambda stored: stored.where)
    checks = RecordChecks(files)
    for stored, key in ((a, "a"), (b, "b")):  # the first half of each storage read so far
        checks.add_part(stored, key, stored.offset, 128, crc32(files.read(stored.relative, stored.offset, 128)))
    checks.finish("a")
    assert checks.has_part(a, a.offset + 128, 128) and not checks.has_part(b, b.offset + 128, 128)
    checks.finish()
    assert checks.has_part(b, b.offset + 128, 128)
