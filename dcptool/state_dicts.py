"""State dicts as trees of entries: flattened into paths as DCP flattens them, nested back, and the
tensors held inside objects (a Trainer's RNG state) split out as tensors of their own.

>>> list(flatten({"model": {"w": 1}, "groups": [{"lr": 0.1}]}))
[(('model', 'w'), 1), (('groups',), [{'lr': 0.1}])]
>>> nest({("model", "w"): 1, ("groups", 0, "lr"): 0.1})
{'model': {'w': 1}, 'groups': [{'lr': 0.1}]}
"""

from __future__ import annotations

from typing import Any

from dcptool.engine.chunks import Chunk
from dcptool.engine.core import Checkpoint, ObjectInfo, TensorInfo, join_path
from dcptool.errors import CheckpointError, UsageError, printable, utf8_problem
from dcptool.safe_pickle import TensorRef
from dcptool.torch_archive import Archive, Unpicklable


def archive_tensor(archive: Archive, tensor: TensorRef, path: tuple) -> TensorInfo:
    """A plain tensor of ``archive`` as one chunk: its elements where they lie in the file."""
    raw = archive.raw_bytes(tensor)
    chunk = Chunk(tuple(0 for _ in raw.shape), raw.shape, raw.file, raw.offset, raw.span, "raw", raw.strides)
    return TensorInfo(path, tensor.dtype.name, raw.shape, [chunk])


def split_object(checkpoint: Checkpoint, obj: ObjectInfo, path: tuple) -> tuple[dict[tuple, Any], list[TensorInfo]]:
    """An object as entries of ``nest`` under ``path``, and the tensors inside it as tensors of their own.

    A tensor inside an object (torch's CPU RNG state in a Trainer's ``rng_state_<r>.pth``) is split
    out as ``read`` splits a file's tensors (``flatten``), its elements read in place from the
    object's archive: a writer stores it like any tensor, as a storage of its own archive, and
    ``nest`` puts it back in its place. Raises ``Unpicklable`` for a tensor that cannot be split out.
    """
    value = checkpoint.object_value(obj)
    if not _holds_tensor(value, {}):
        return {path: value}, []
    if obj.blob is None:  # readers split out the tensors of what they unpickle whole: none are left
        raise Unpicklable(f"{printable(join_path(path))}: holds tensors outside a torch.save archive")
    archive = checkpoint.object_archive(obj)
    entries, tensors = {}, []
    for nested, leaf in flatten(value, path, archive.where):
        if not isinstance(leaf, TensorRef):
            entries[nested] = leaf
        elif leaf.subclass:
            raise Unpicklable(f"{archive.where}: {printable(join_path(nested))} is a {printable(leaf.subclass)}, "
                              "not a plain tensor")
        else:
            tensors.append(archive_tensor(archive, leaf, nested))
    return entries, tensors


def flatten(obj, prefix: tuple[str, ...] = (), where: object = "state dict"):
    """Yield ``(path, leaf)`` as DCP flattens a state dict: into dicts, and into lists that hold tensors.

    Keys become their ``str``, as in DCP; one that is not UTF-8 text is refused, naming ``where``.
    ``obj`` comes from ``safe_pickle.load_bytes``, which bounds its nesting and size.
    """
    yield from _flatten(obj, prefix, where, {})


def _flatten(obj, prefix: tuple, where, holds: dict):
    if isinstance(obj, dict) and obj:
        for key, value in obj.items():
            name = key if type(key) is str else str(key)
            problem = utf8_problem(name)
            if problem:
                raise CheckpointError(f"{where}: the key under {printable(join_path(prefix)) or 'the top level'} {problem}")
            yield from _flatten(value, prefix + (name,), where, holds)
    elif isinstance(obj, (list, tuple)) and prefix and _holds_tensor(obj, holds):
        for index, value in enumerate(obj):
            yield from _flatten(value, prefix + (index,), where, holds)
    else:
        yield prefix, obj


def _holds_tensor(obj, seen: dict[int, bool]) -> bool:
    """Whether a tensor is nested in ``obj``'s dicts, lists and tuples (each shared container looked at once)."""
    found = seen.get(id(obj))
    if found is None:
        if isinstance(obj, TensorRef):
            found = True
        elif isinstance(obj, dict):
            found = any(_holds_tensor(value, seen) for value in obj.values())
        elif isinstance(obj, (list, tuple)):
            found = any(_holds_tensor(value, seen) for value in obj)
        else:
            found = False
        seen[id(obj)] = found  # obj lives as long as the state dict it is in: its id stays its own
    return found


def plain_data(value: Any) -> bool:
    """Whether ``value`` is made of Python's plain data only (dicts, lists, tuples, strings, bytes, numbers,
    None), which any unpickler reads back, torch's ``weights_only`` loading included."""
    if isinstance(value, (list, tuple)):
        return all(plain_data(v) for v in value)
    if isinstance(value, dict):
        return all(plain_data(k) and plain_data(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str, bytes))


def nest(entries: dict[tuple, object]) -> dict:
    """Rebuild the nesting from paths, as DCP does: ``{("model", "w"): t, ("groups", 0, "lr"): 1}`` ->
    ``{"model": {"w": t}, "groups": [{"lr": 1}]}`` (int parts index lists)."""
    root: dict = {}
    for path, value in entries.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"{join_path(path)}: a parent of this entry is itself an entry")
        if path[-1] in node:
            raise UsageError(f"{join_path(path)}: two entries have this path")
        node[path[-1]] = value
    return _lists(root)


def _lists(node):
    if not isinstance(node, dict):
        return node
    node = {key: _lists(value) for key, value in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node
