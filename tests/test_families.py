"""Naming families as plug-ins (dcptool.families): one module per family that declares what it is, a registry that
alone imports them, and no other module naming a family; formats declare the classes their pickles hold, so the
restricted unpickler names no format either."""

from __future__ import annotations

import ast
import io
import pkgutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from dcptool import families
from dcptool.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
# Beside its own module and its format's, a family is named by the model kinds' tables (its names of each
# kind's parameters) and by the command line's help and examples, which speak to the user in its name.
NAMED_BY_ALL = ("dcptool/models/", "dcptool/cli/")


def named_families(text: str, names: list[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of every code token of ``text`` holding one of ``names`` (case aside): identifiers and
    string literals; comments and docstrings are prose, and may say whose format or engine does what."""
    tree = ast.parse(text)
    docstrings = {(node.body[0].lineno, node.body[0].col_offset) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)}
    found = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.NAME or (token.type == tokenize.STRING and token.start not in docstrings):
            found += [(token.start[0], name) for name in names if name in token.string.lower()]
    return found


def sources() -> list[Path]:
    """The package's modules and the formats' (dcptool/converters is a link to converters/: read once)."""
    inside = [path for path in (ROOT / "dcptool").rglob("*.py") if "converters" not in path.relative_to(ROOT).parts]
    return sorted([*inside, *(ROOT / "converters").rglob("*.py")])


def places_of(family) -> tuple[str, ...]:
    """Where ``family`` may be named: its module (or package), its own format's, and everyone's."""
    places = [f"dcptool/families/{family.name}.py", f"dcptool/families/{family.name}/", *NAMED_BY_ALL]
    if family.output_format:
        places += [f"converters/{family.output_format}.py", f"converters/{family.output_format}/"]
    return tuple(places)


def test_a_family_is_named_only_by_its_module_its_format_and_the_model_kinds():
    """The hub's name (hf) is a format's too and HF's words are everyone's; every other family's name appears in
    code only in its own places, so a new family touches its module, its format and the model kinds."""
    named = {family.name: family for family in families.all_families().values() if not family.hub}
    assert set(named) >= {"archon", "torchtitan", "megatron"}
    misplaced = []
    for path in sources():
        where = path.relative_to(ROOT).as_posix()
        for line, name in named_families(path.read_text(), list(named)):
            if not where.startswith(places_of(named[name])):
                misplaced.append(f"{where}:{line} names {name}")
    assert misplaced == []


def test_the_search_reads_code_not_prose():
    text = ('"""Megatron in a docstring."""\n# torchtitan in a comment\nx = "archon"\n\n'
            'def is_megatron():\n    """megatron"""\n    return f"{x} torchtitan"\n')
    assert named_families(text, ["archon", "torchtitan", "megatron"]) == [(3, "archon"), (5, "megatron"),
                                                                          (7, "torchtitan")]


def test_the_registry_lists_the_package():
    modules = {info.name for info in pkgutil.iter_modules(families.__path__)}
    assert set(families.names()) == modules
    assert [family.name for family in families.all_families().values() if family.hub] == ["hf"] == families.names()[:1]
    with pytest.raises(UsageError, match="choose one of hf, archon, torchtitan, megatron"):
        families.get("vllm")


def test_detection_by_names():
    """The family naming the most names; Archon's names are torchtitan's before 0.3, and read as Archon's."""
    archon_names = ["layers.0.attention.wq.weight", "layers.0.attention.wk.weight", "tok_embeddings.weight"]
    assert families.detect(archon_names).name == "archon"
    assert families.detect(["model.layers.0.self_attn.q_proj.weight"]).name == "hf"
    assert families.detect(["decoder.layers.self_attention.linear_qkv.weight"]).name == "megatron"
    assert families.detect(["wte.weight"]) is None


def test_options_go_with_the_family_that_takes_them():
    mesh = {"dp": None, "tp": 2, "ep": 1, "etp": 1, "cp": 1, "dp_replicate": 1, "world_size": None}
    titan, mcore = families.get("torchtitan"), families.get("megatron")
    with pytest.raises(UsageError, match=r"make_vocab_size_divisible_by goes with family='megatron'"):
        families.given("torchtitan", make_vocab_size_divisible_by=64)
    assert families.given("torchtitan", make_vocab_size_divisible_by=None) is None
    assert families.options_for(titan, mesh, None, None) is None
    chosen = families.given("megatron", make_vocab_size_divisible_by=64)
    options = families.options_for(mcore, mesh, "bfloat16", chosen)
    assert (options.tp, options.vocab_multiple, options.padded_multiple, options.dtype) == (2, 64, 128, "bfloat16")
    with pytest.raises(UsageError, match="make_vocab_size_divisible_by=0"):
        families.options_for(mcore, mesh, None, families.given("megatron", make_vocab_size_divisible_by=0))
    with pytest.raises(UsageError, match="MegatronFamilyOptions goes with family='megatron', not family='hf'"):
        families.options_for(families.hub(), {}, None, chosen)
    assert families.options_for(families.hub(), {}, None, families.given("hf", hf_experts="fused")).fused_experts
    assert families.options_for(mcore, mesh, None).spec == "local"
    assert families.options_for(mcore, mesh, None, families.given("megatron", megatron_spec="te")).spec == "te"
    with pytest.raises(UsageError, match="megatron_spec='fused': choose local or te"):
        families.options_for(mcore, mesh, None, families.given("megatron", megatron_spec="fused"))


def test_a_family_says_which_meshes_its_output_takes():
    mesh = {"dp": None, "tp": 2, "ep": 1, "etp": 1, "cp": 1, "dp_replicate": 1, "world_size": None}
    assert families.get("torchtitan").output_mesh(mesh) == mesh
    assert families.get("megatron").output_mesh(mesh)["tp"] == 1  # one checkpoint: Megatron reshards as it loads
    with pytest.raises(UsageError, match="drop dp"):
        families.get("megatron").output_mesh({**mesh, "dp": 2})
    assert families.get("megatron").output_format == "megatron" and families.get("archon").output_format is None


# A protocol-2 pickle of Megatron-Core's ModelType(1), as Megatron-LM's args hold it.
MODEL_TYPE = b"\x80\x02cmegatron.core.enums\nModelType\nK\x01\x85R."
UNPICKLE = f"""
from dcptool import formats, safe_pickle
from dcptool.errors import UnsafePickleError
try:
    safe_pickle.load_bytes({MODEL_TYPE!r}, "common.pt")
except UnsafePickleError:
    print("refused")
formats.all_formats()  # the registry lets each format's declared classes through
print(safe_pickle.load_bytes({MODEL_TYPE!r}, "common.pt").args)
"""


def test_the_unpickler_takes_a_class_once_its_format_declares_it():
    """The unpickler alone knows torch's and Python's classes; Megatron's enum reads once the format registry
    has loaded the format that declares it (its ``safe_globals``)."""
    result = subprocess.run([sys.executable, "-c", UNPICKLE], capture_output=True, text=True, cwd=ROOT)
    assert result.stdout.split() == ["refused", "(1,)"], result.stderr
