"""The option objects of the Python API: what the command line's flags stand for, grouped by what they are about.

Every command of ``dcptool.api`` takes its options as a few of these frozen dataclasses (and a format's own
options, ``dcptool.format_options``), never as a long list of keywords: ``Reading`` (how sources are read),
``Writing`` (how an output is written), ``Selection`` (which entries), ``MeshOptions`` (the mesh to lay a
checkpoint out for), ``Completeness`` (what parts of the model an output may lack), ``Lora``, ``Quantize`` and
``HubPush`` (export-hf), ``Tolerance``, ``Side`` and ``LoadOn`` (verify and diff). The command line builds the same
objects from its flags (``dcptool/cli/options.py``), so both run one path.

A message names an option as its caller gave it (``errors.option``): the flag on the command line
(``--tp 3``), the object's field in Python, by the keyword the object was passed as (``mesh.tp=3``). Each field
is known to messages by a key (``keys``): its own name, or where one name would mean two things, the name of
its flag (``Lora.mode`` is ``lora``, ``Side.prefix`` of side A is ``prefix_a``). Values are checked where they
are used, so a message raised by a command names them as the caller passed them.

>>> from dcptool.options import MeshOptions, Reading
>>> MeshOptions.parse("dp=2,tp=4", plan="hf")
MeshOptions(dp=2, tp=4, ep=1, etp=1, cp=1, dp_replicate=1, world_size=None, plan='hf')
>>> Reading(max_memory="1GiB").budget()
1073741824
>>> MeshOptions.keys("mesh")["etp"], Side.keys("side_b")["prefix_b"], Lora.keys("lora")["lora_config"]
('mesh.etp', 'side_b.prefix', 'lora.config')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any, Callable, ClassVar, ContextManager, Union

from dcptool.errors import UsageError, option
from dcptool.mesh import parse_mesh
from dcptool.sizes import DEFAULT_MAX_MEMORY, parse_size

Size = Union[int, str]  # bytes, or text such as "256MiB" or "5GB" (dcptool.sizes)
# ``progress(total_bytes or None, label)`` returns a context manager that yields ``advance(n)``.
Progress = Callable[[Union[int, None], str], ContextManager[Callable[[int], None]]]


class Options:
    """What every option object shares: how messages name its fields (``keys``) and which were set (``given``)."""

    # field -> the key messages name it by (errors.option), where that is not the field's own name
    KEYS: ClassVar[dict[str, str]] = {}

    @classmethod
    def keys(cls, keyword: str) -> dict[str, str]:
        """Each field's message key -> the field as a caller who passed the object as ``keyword`` names it."""
        return {cls.KEYS.get(f.name, f.name): f"{keyword}.{f.name}" for f in fields(cls)}

    def given(self) -> dict[str, Any]:
        """The fields set to anything but their defaults, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}


@dataclass(frozen=True, kw_only=True)
class Reading(Options):
    """How a command reads its sources: ``--from``, ``--revision``, ``--no-verify-records``, ``--dequantize``,
    ``--max-memory``, and the progress bar.

    Args:
        format: the sources' format (detected when None).
        revision: the branch, tag or commit of a source that is a Hugging Face hub repo.
        verify_records: check every record read (``torch.save`` archives: DCP chunks and objects, ``torch.save``
            and FSDP1 files) as torch would and its CRC-32s as its bytes pass; False reads them unchecked, for a
            caller who accepts the risk.
        dequantize: block-scaled float8 weights and MXFP4 experts become ``dtype`` (default bfloat16) tensors as they
            are read.
        max_memory: the budget for data buffers (bytes, or text such as ``"1GiB"``); larger tensors move in pieces.
        progress: ``progress(total_bytes, label)`` returning a context manager that yields ``advance(n)``
            (the command line passes its progress bar).

    Example:
        >>> Reading(revision="main", max_memory="64MiB").budget()
        67108864
    """

    format: str | None = None
    revision: str | None = None
    verify_records: bool = True
    dequantize: bool = False
    max_memory: Size = DEFAULT_MAX_MEMORY
    progress: Progress | None = None

    def budget(self) -> int:
        """``max_memory`` in bytes."""
        return parse_size(self.max_memory, "max_memory")


@dataclass(frozen=True, kw_only=True)
class Writing(Options):
    """How a command writes its output: ``--overwrite``, ``--no-fsync``, ``--dry-run``.

    Args:
        overwrite: replace an output that exists (only once the new one is complete).
        fsync: flush the output to disk before renaming it into place (False: faster; after a power loss a
            renamed output may be incomplete).
        dry_run: plan and report what would be written, and write nothing.

    Example:
        >>> Writing(overwrite=True).given()
        {'overwrite': True}
    """

    overwrite: bool = False
    fsync: bool = True
    dry_run: bool = False


@dataclass(frozen=True, kw_only=True)
class Selection(Options):
    """Which entries a command takes: ``--include``, ``--exclude``, and export-hf's ``--prefix``.

    Args:
        include: only keys matching this regular expression.
        exclude: leave out keys matching this regular expression.
        prefix: the wrapper of the model's keys (``"dcp.model"``; found by itself when None).

    Example:
        >>> Selection(exclude=r"^optimizer\\.").given()
        {'exclude': '^optimizer\\\\.'}
    """

    include: str | None = None
    exclude: str | None = None
    prefix: str | None = None


@dataclass(frozen=True, kw_only=True)
class MeshOptions(Options):
    """The mesh to lay a checkpoint out for, as a job on it saves it: ``--dp``, ``--tp``, ``--ep``, ``--etp``,
    ``--cp``, ``--dp-replicate``, ``--world-size``, ``--plan`` (``inspect --mesh`` as text).

    Args:
        dp: the FSDP shard degree (None: the source's world size over the other sizes, else 1).
        tp, ep, cp, dp_replicate: tensor-, expert- and context-parallel degrees, HSDP replicas.
        etp: the experts' tensor-parallel degree: 1, or ``"tp"`` (or tp's number) for tp.
        world_size: the target job's ranks; must equal dp_replicate*dp*cp*tp.
        plan: the placement plan: auto, hf, torchtitan, transformers, fsdp, or a YAML/JSON plan file.

    Example:
        >>> MeshOptions(tp=2, etp="tp").sizes()["etp"]
        2
    """

    dp: int | None = None
    tp: int = 1
    ep: int = 1
    etp: int | str = 1
    cp: int = 1
    dp_replicate: int = 1
    world_size: int | None = None
    plan: str = "auto"

    @classmethod
    def parse(cls, text: str, keyword: str = "mesh", plan: str = "auto") -> MeshOptions:
        """The mesh of text such as ``dp=2,tp=4,ep=2,etp=tp``; text that is not sizes is refused naming ``keyword``."""
        return cls(**parse_mesh(text, keyword), plan=plan)

    def sizes(self) -> dict[str, int | None]:
        """The sizes as ``resharding.resolve_mesh`` takes them, ``etp="tp"`` as tp's number; a bad etp is refused."""
        if self.etp != "tp" and not str(self.etp).isdigit():
            raise UsageError(f"{option('etp', self.etp)}: give 1 or tp")
        return {"dp": self.dp, "tp": self.tp, "ep": self.ep, "etp": self.tp if self.etp == "tp" else int(self.etp),
                "cp": self.cp, "dp_replicate": self.dp_replicate, "world_size": self.world_size}

    def sizes_given(self) -> bool:
        """Whether any size asks for other than one rank of one process (the plan alone does not)."""
        return any(value not in (None, 1, "1") for value in self.sizes().values())


@dataclass(frozen=True, kw_only=True)
class Completeness(Options):
    """What an HF-named output may lack of the model its config describes, or hold beyond it (export-hf,
    import-hf, convert to HF names): ``--allow-missing``, ``--allow-unexpected``. Anything else it lacks is refused
    (``errors.IncompleteModelError``), since ``from_pretrained`` would fill it with random weights.

    Args:
        allow_missing: the parts it may lack (``"vision"``, ``"mtp"``, ``"lm_head"``, ...: ``dcptool.models.PARTS``),
            as a sequence or a comma-separated text (``"vision,mtp"``).
        allow_unexpected: keep tensors the model has no place for (``from_pretrained`` ignores them).

    Example:
        >>> Completeness(allow_missing="vision,mtp").parts()
        ('vision', 'mtp')
    """

    allow_missing: str | Sequence[str] = ()
    allow_unexpected: bool = False

    def parts(self) -> tuple[str, ...]:
        """``allow_missing`` as part names, each once (the command checks them against ``models.PARTS``)."""
        given = [self.allow_missing] if isinstance(self.allow_missing, str) else list(self.allow_missing)
        return tuple(dict.fromkeys(part.strip() for text in given for part in text.split(",") if part.strip()))


LORA_MODES = ("merge", "adapter")


@dataclass(frozen=True)
class Lora(Options):
    """export-hf of a peft (LoRA) model's checkpoint: ``--lora``, ``--lora-config``, ``--lora-alpha``.

    Args:
        mode: ``"merge"`` merges every adapter into the base weights; ``"adapter"`` writes a PEFT adapter folder.
        config: the adapter's ``adapter_config.json`` (lora_alpha, use_rslora, ...); default: one beside the
            checkpoint.
        alpha: lora_alpha (the merge scales B @ A by lora_alpha / r), over the config's.

    Example:
        >>> Lora("merge", alpha=16)
        Lora(mode='merge', config=None, alpha=16)
    """

    KEYS: ClassVar[dict[str, str]] = {"mode": "lora", "config": "lora_config", "alpha": "lora_alpha"}

    mode: str
    _: KW_ONLY
    config: str | None = None
    alpha: float | None = None


@dataclass(frozen=True)
class Quantize(Options):
    """export-hf's quantized output: ``--quantize``, ``--block-size``, ``--scale-format``, ``--quant-format``.

    Args:
        scheme: ``"fp8"`` (every linear weight of the decoder layers as float8_e4m3fn with a float32 scale per block,
            as DeepSeek-V3 and Qwen3-FP8 releases store them), ``"mxfp4"`` (GPT-OSS's experts as MXFP4 blocks and
            scales) or ``"like=DIR"`` (the quantization of the released model folder DIR: its config.json's
            ``quantization_config``, and where its safetensors are there, which weights it quantized).
        block_size: rows and columns of weight per fp8 scale, ``"128x128"`` or ``(128, 128)`` (the default).
        scale_format: ``"float"`` (each block's amax / 448, the default) or ``"ue8m0"`` (rounded up to a power of
            two, DeepSeek-V3.1's ``scale_fmt``).
        layout: ``"native"`` (the quant_method's own tensors: ``X.weight_scale_inv``; the default) or
            ``"compressed-tensors"`` (``X.weight_scale`` and a compressed-tensors quantization_config, as
            llm-compressor writes it).

    Example:
        >>> Quantize("fp8", block_size="64x128").block()
        (64, 128)
    """

    KEYS: ClassVar[dict[str, str]] = {"scheme": "quantize", "layout": "quant_format"}

    scheme: str
    _: KW_ONLY
    block_size: str | tuple[int, int] | None = None
    scale_format: str | None = None
    layout: str | None = None

    def like(self) -> str | None:
        """The released model folder of ``like=DIR``; None for a scheme named."""
        return self.scheme.removeprefix("like=") if self.scheme.startswith("like=") else None

    def block(self) -> tuple[int, int] | None:
        """``block_size`` as (rows, columns), checked; None when not given."""
        given = self.block_size
        if given is None:
            return None
        parts = given.lower().split("x") if isinstance(given, str) else list(given)
        try:
            block = tuple(int(part) for part in parts)
        except (TypeError, ValueError):
            block = ()
        if len(block) != 2 or min(block) < 1:
            raise UsageError(f"{option('block_size', given)}: give rows and columns of weight per scale, as 128x128")
        return block


@dataclass(frozen=True)
class HubPush(Options):
    """export-hf's upload to a Hugging Face hub model repo: ``--push-to-hub``, ``--private``, ``--push-branch``,
    ``--commit-message``.

    Args:
        repo: the repo, ``ORG/NAME`` (created if missing).
        private: create the repo private (an existing repo keeps its visibility).
        branch: the branch to upload to, created if missing (e.g. one per step).
        commit_message: the commit message.

    Example:
        >>> HubPush("my-org/run-7", branch="step-1000").given()
        {'repo': 'my-org/run-7', 'branch': 'step-1000'}
    """

    KEYS: ClassVar[dict[str, str]] = {"repo": "push_to_hub", "branch": "push_branch"}

    repo: str
    _: KW_ONLY
    private: bool = False
    branch: str | None = None
    commit_message: str | None = None


@dataclass(frozen=True, kw_only=True)
class Tolerance(Options):
    """What verify lets pass as equal: ``--atol``, ``--rtol``, ``--dtype-as``, ``--values-only``.

    Args:
        atol, rtol: absolute and relative (of A's values) tolerances of floating-point values (None: bitwise).
        dtype_as: ``"b"``: compare after casting A's floating-point tensors to B's dtypes (as torch's
            ``.to(dtype)`` rounds); ``"a"``: B's to A's.
        values_only: equal values pass even where the layouts differ (the model at ``model.`` in one, at the
            top level in the other).

    Example:
        >>> Tolerance(atol=1e-2, rtol=1e-2).given()
        {'atol': 0.01, 'rtol': 0.01}
    """

    atol: float | None = None
    rtol: float | None = None
    dtype_as: str | None = None
    values_only: bool = False


@dataclass(frozen=True, kw_only=True)
class Side(Options):
    """How verify and diff read one side, A or B: ``--prefix-a``, ``--from-a``, ``--adapter-a`` (and B's).

    Args:
        prefix: compare only keys under this wrapper, with it stripped (``"dcp.model"``; ``"auto"``: the model part).
        format: the side's format (detected when None).
        family: the naming family of the side's weights (``"auto"``: detected).

    Example:
        >>> Side(prefix="auto").given()
        {'prefix': 'auto'}
    """

    prefix: str | None = None
    format: str | None = None
    family: str = "auto"

    @classmethod
    def keys(cls, keyword: str) -> dict[str, str]:
        """Keyed by the side's letter, as its flags are: ``side_a.prefix`` is ``prefix_a``."""
        letter = keyword.removeprefix("side_")
        return {f"{f.name}_{letter}": f"{keyword}.{f.name}" for f in fields(cls)}


@dataclass(frozen=True)
class LoadOn(Options):
    """verify's real multi-process ``dcp.load`` of A (needs torch): ``--load-on``, ``--nproc``, ``--backend``,
    ``--plan``, ``--timeout``.

    Args:
        mesh: the mesh to load on, as text (``"dp=2,tp=2,ep=2,etp=tp"``) or sizes by name.
        nproc: processes to start (default: the mesh's world size).
        backend: ``"auto"`` (nccl when GPUs are present, else gloo), ``"gloo"`` or ``"nccl"``.
        plan: the placement plan the load job lays the tensors out by.
        timeout: seconds before the job is killed.

    Example:
        >>> LoadOn("dp=2,tp=2").sizes()
        {'dp': 2, 'tp': 2}
    """

    KEYS: ClassVar[dict[str, str]] = {"mesh": "load_on"}

    mesh: str | Mapping[str, int]
    _: KW_ONLY
    nproc: int | None = None
    backend: str = "auto"
    plan: str = "auto"
    timeout: float = 600.0

    def sizes(self) -> dict[str, int]:
        """The mesh's sizes by name; text that is not sizes is refused."""
        return parse_mesh(self.mesh, "load_on") if isinstance(self.mesh, str) else dict(self.mesh)
