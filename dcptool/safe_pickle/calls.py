"""What a pickle may ask of the machine beyond pushing values, each checked and charged to a budget.

``Calls`` holds the state of one run that these need (the pickle's bytes, the memo, the work spent)
and does the calls of allowed globals (REDUCE, NEWOBJ, OBJ), BUILD, and the hashing of dict and set
keys; ``machine.Machine``, its subclass, interprets the opcodes. Work is counted in units (items
copied, hashed or set) against a budget proportional to the pickle's size, so that no pickle of N
bytes costs more than O(N) time however it shares or nests its containers.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from dcptool.dtypes import DType
from dcptool.errors import SIZE_LIMIT, UnsafePickleError, printable
from dcptool.safe_pickle.allowlist import (ALLOWED, FUNCTIONS, NDARRAY, NUMPY_CODES, PLAIN_TENSOR_STATE_KEYS,
                                           PLAIN_TENSOR_TYPES, RECORD_TYPES, SHARDED_TENSOR, ArrayShell, Bad, Method,
                                           Name, NumpyDtype, Record, StorageRef, SubclassRef, TensorRef, brief,
                                           checked_count, checked_dims, latin1_bytes, pathlib_path, rebuild_parameter,
                                           rebuild_tensor, rebuild_tensor_v3)

MAX_DEPTH = 64  # dict and set keys nested deeper than this are refused (hashing them recurses in C)
WORK_PER_BYTE = 16  # work units (items copied, hashed, set) a pickle may ask for, per byte of it
BASE_ALLOWANCE = 1 << 16  # added to the budgets, so that small pickles with some sharing pass
MAX_SAME_HASH = 32  # distinct non-string keys with one hash in one dict or set (more is hash flooding)


class Calls:
    """The calls, BUILDs and keys of one run over ``data`` (``source`` names the file in messages)."""

    def __init__(self, data: bytes, source: str):
        self.data, self.source = data, source
        self.work = 0
        self.budget = WORK_PER_BYTE * len(data) + BASE_ALLOWANCE
        # Hash cost and nesting of the tuples and frozensets made here, kept alive so ids stay theirs.
        self.hashing: dict[int, tuple[Any, int, int]] = {}
        # Per dict or set: how many non-string keys share each hash.
        self.hashes: dict[int, tuple[Any, dict[int, int]]] = {}
        self.memo: list = []  # the run's memo (numpy arrays replace their shells in it)
        self.shells = 0  # numpy arrays made by _reconstruct and not yet given their data

    # -- budgets ---------------------------------------------------------------------------

    def charge(self, units: int) -> None:
        """Spend ``units`` of the budget; a pickle that asks for more than it holds is refused."""
        self.work += units
        if self.work > self.budget:
            raise Bad(f"asks for more work than a pickle of {len(self.data):,} bytes can "
                      "(shared containers copied or hashed over and over)")

    def hash_cost(self, key: Any) -> tuple[int, int]:
        """What hashing ``key`` costs (items visited, shared items counted each time) and how deep it nests.

        Tuples and frozensets are measured once each, bottom up without recursion (a pickle can nest
        them a million deep in two bytes a level), and remembered.
        """
        kind = type(key)
        if kind is int:
            return 1 + key.bit_length() // 1024, 1
        if kind is not tuple and kind is not frozenset:
            return 1, 1
        known = self.hashing
        todo: list[tuple[Any, bool]] = [(key, False)]
        while todo:
            obj, ready = todo.pop()
            entry = known.get(id(obj))
            if entry is not None and entry[0] is obj:
                continue
            if not ready:
                todo.append((obj, True))
                todo.extend((item, False) for item in obj if type(item) is tuple or type(item) is frozenset)
                continue
            cost, depth = 1, 1
            for item in obj:
                if type(item) is tuple or type(item) is frozenset:
                    _, item_cost, item_depth = known[id(item)]
                    cost += item_cost
                    depth = max(depth, item_depth + 1)
                else:
                    cost += 1 + item.bit_length() // 1024 if type(item) is int else 1
            known[id(obj)] = (obj, min(cost, SIZE_LIMIT), depth)  # holding obj keeps its id its own
        _, cost, depth = known[id(key)]
        return cost, depth

    def key(self, container: Any, key: Any) -> None:
        """Check (and pay for) hashing ``key`` into ``container`` before it is done."""
        kind = type(key)
        if kind is str or kind is bytes or kind is Name:
            return  # randomized hashes, cached: cheap and not floodable
        cost, depth = self.hash_cost(key)
        if depth > MAX_DEPTH:
            raise Bad(f"a dict or set key nests more than {MAX_DEPTH} levels")
        entry = self.hashes.get(id(container))
        if entry is None or entry[0] is not container:
            entry = self.hashes[id(container)] = (container, {})
        counts = entry[1]
        self.charge(cost)
        value = hash(key)  # TypeError for unhashable keys
        seen = counts.get(value, 0) + 1
        if seen > MAX_SAME_HASH:
            raise Bad(f"more than {MAX_SAME_HASH} keys of one dict or set share a hash (hash flooding)")
        counts[value] = seen
        self.charge(cost * seen)  # the comparisons with the keys that share it

    def set_item(self, target: Any, key: Any, value: Any) -> None:
        """``target[key] = value`` for SETITEM and DICT, the key checked and paid for."""
        if not isinstance(target, dict):
            raise Bad(f"sets an item of a {brief(target)}, not of a dict")
        self.key(target, key)
        target[key] = value

    def add_items(self, target: set, items) -> None:
        """``target.add(item)`` for each of ``items`` (ADDITEMS, FROZENSET), each checked and paid for."""
        for item in items:
            self.key(target, item)
            target.add(item)

    # -- calls -------------------------------------------------------------------------------

    def call(self, func: Any, args: Any, kwargs: Any = None) -> Any:
        """``func(*args)`` for the callables a checkpoint may use, each with its arguments checked."""
        if type(args) is not tuple:
            raise Bad(f"call arguments are a {brief(args)}, not a tuple")
        if kwargs:
            raise Bad("keyword arguments in a call")
        self.charge(len(args) + 1)
        if func is tuple or func is set or func is frozenset:  # tuple: torch.Size, in every tensor's pickle
            if len(args) > 1 or args and not isinstance(args[0], (list, tuple)):
                raise Bad(f"{func.__name__}() of something other than a list")
            items = args[0] if args else ()
            self.charge(len(items))
            if func is tuple:
                return tuple(items)
            made: set = set()
            self.add_items(made, items)
            return frozenset(made) if func is frozenset else made
        if type(func) is Method:
            return getattr(self, "_" + func)(*args)
        if id(func) in FUNCTIONS:
            if func is latin1_bytes or func is pathlib_path:
                self.charge(sum(len(a) for a in args if isinstance(a, str)))
            return func(*args)
        if type(func) is type and func in RECORD_TYPES:
            return func.__new__(func, *args)
        if func is SubclassRef:
            return SubclassRef(SHARDED_TENSOR, args=args)
        if func is collections.OrderedDict:
            if args:
                raise Bad("OrderedDict made with arguments (pickles give it its items afterwards)")
            return collections.OrderedDict()
        if func is slice:
            if not 1 <= len(args) <= 3 or not all(a is None or type(a) is int and a.bit_length() < 64 for a in args):
                raise Bad("slice of something other than small integers")
            return slice(*args)
        if func is bytes:
            if args:
                raise Bad("bytes() made from arguments (pickles call it only for b'')")
            return b""
        if func is complex:
            numbers = all(type(a) is float or type(a) is int and a.bit_length() < 1024 for a in args)
            if len(args) > 2 or not numbers:
                raise Bad("complex of something other than two numbers")
            return complex(*args)
        raise Bad(f"calls a {brief(func)}, which is not a checkpoint constructor")

    def new_object(self, cls: Any, args: Any, kwargs: Any = None) -> Any:
        """NEWOBJ: ``cls.__new__(cls, *args)`` for the classes ``call`` allows."""
        if isinstance(cls, type) and issubclass(cls, Record):
            if type(args) is not tuple:
                raise Bad(f"NEWOBJ arguments are a {brief(args)}, not a tuple")
            self.charge(len(args) + 1)
            return cls.__new__(cls, *args)
        if cls is set or cls is collections.OrderedDict:
            return cls()  # __new__ ignores its arguments; the items come afterwards
        if not isinstance(cls, type):
            raise Bad(f"NEWOBJ of a {brief(cls)}, which is not a class")
        return self.call(cls, args, kwargs)

    def build(self, inst: Any, state: Any) -> Any:
        """BUILD: give an object its pickled state; returns what stands in its place (itself but for numpy arrays)."""
        if isinstance(state, dict):
            self.charge(len(state) + 1)
        elif isinstance(state, tuple) and len(state) == 2:
            self.charge(sum(len(s) for s in state if isinstance(s, dict)) + 1)
        if isinstance(inst, Record):
            Record.__setstate__(inst, state)  # through the class: an attribute named __setstate__ is data
        elif type(inst) is SubclassRef:
            SubclassRef.__setstate__(inst, state)
        elif type(inst) is collections.OrderedDict and isinstance(state, dict) and all(type(k) is str for k in state):
            inst.__dict__.update(state)  # a state dict's _metadata
        elif type(inst) is NumpyDtype:
            # numpy.dtype.__reduce__ of a plain numeric dtype: (3, byte order, None, None, None, -1, -1, 0)
            plain = type(state) is tuple and len(state) == 8 and state[2:5] == (None, None, None)
            if not (plain and all(type(v) is int for v in state[:1] + state[5:])
                    and (state[0], *state[5:]) == (3, -1, -1, 0) and state[1] in ("<", ">", "|", "=")
                    and type(state[1]) is str and inst.order is None):
                raise Bad(f"numpy dtype {inst.code} with state {brief(state)}, not a plain numeric dtype's")
            inst.order = state[1]
        elif type(inst) is ArrayShell:
            return self.numpy_array_state(inst, state)
        else:
            raise Bad(f"gives state to a {brief(inst)}")
        return inst

    def numpy_array_state(self, shell: ArrayShell, state: Any) -> np.ndarray:
        """``ndarray.__setstate__((1, shape, dtype, is_fortran, raw bytes))`` done as ``np.frombuffer`` of checked bytes."""
        if not (type(state) is tuple and len(state) == 5 and state[0] == 1 and type(state[0]) is int):
            raise Bad(f"numpy array state {brief(state)}, not (1, shape, dtype, order, bytes)")
        _, size, element, fortran, raw = state
        shape = checked_dims("numpy array shape", size)
        if type(element) is not NumpyDtype or type(fortran) is not bool:
            raise Bad(f"numpy array of dtype {brief(element)}, not a numeric dtype")
        if type(raw) is not bytes:  # object arrays pickle a list of objects here
            raise Bad(f"numpy array data is a {brief(raw)}, not bytes (object arrays are not checkpoint data)")
        kind = element.resolve()
        count = 1
        for n in shape:
            count *= n
        if count * kind.itemsize != len(raw):
            raise Bad(f"numpy array {list(shape)} of {kind} needs {count * kind.itemsize:,} bytes, has {len(raw):,}")
        memo = self.memo
        self.charge(len(memo) - shell.memo_from + 1)
        # a writable array in native byte order, as numpy's own unpickling gives (it swaps big-endian data)
        value = np.frombuffer(raw, dtype=kind).astype(kind.newbyteorder("=")).reshape(shape, order="F" if fortran else "C")
        for index in range(shell.memo_from, len(memo)):
            if memo[index] is shell:
                memo[index] = value
        self.shells -= 1
        return value

    def _numpy_dtype(self, code, align=False, copy=True):
        if type(code) is not str or code not in NUMPY_CODES or type(align) is not bool or type(copy) is not bool:
            raise Bad(f"numpy dtype {brief(code)} is not a plain numeric dtype")
        return NumpyDtype(code)

    def _numpy_array(self, cls, shape, typecode):
        # numpy pickles an array as _reconstruct(ndarray, (0,), b"b"), then BUILD with its state
        if cls is not NDARRAY or shape != (0,) or typecode != b"b":
            raise Bad(f"numpy _reconstruct of {brief(cls)}, not of a plain ndarray")
        self.shells += 1
        return ArrayShell(len(self.memo))

    def _numpy_scalar(self, element, raw):
        if type(element) is not NumpyDtype or type(raw) is not bytes or len(raw) != element.resolve().itemsize:
            raise Bad(f"numpy scalar of {brief(element)} from {brief(raw)}, not a numeric dtype and its bytes")
        return np.frombuffer(raw, dtype=element.resolve()).astype(element.resolve().newbyteorder("="))[0]

    def _rebuild_from_type(self, func, new_type, args, state):
        # torch pickles tensor subclasses (DTensor, Parameter subclasses) as "rebuild base, then set type and state".
        if any(new_type is plain for plain in PLAIN_TENSOR_TYPES):
            return self.plain_tensor(func, new_type, args, state)
        if not (new_type is SubclassRef or isinstance(new_type, type) and issubclass(new_type, Record)):
            raise Bad(f"tensor subclass {brief(new_type)} is not a checkpoint type")
        if type(func) is Method and func == "rebuild_from_type":  # the base is a tensor, never a subclass
            raise Bad("a tensor subclass rebuilt from another")
        base = self.call(func, args)
        if isinstance(base, TensorRef):
            base.subclass = SHARDED_TENSOR if new_type is SubclassRef else new_type.qualname
            base.subclass_state = state
            return base
        if isinstance(base, SubclassRef):
            base.state = state
            return base
        raise Bad(f"unexpected tensor subclass payload {brief(base)}")

    def plain_tensor(self, func, new_type, args, state) -> TensorRef:
        """A plain tensor or parameter that carries Python attributes (FSDP1's ``_has_been_cloned``): the tensor."""
        if not any(func is f for f in (rebuild_tensor, rebuild_tensor_v3, rebuild_parameter)):
            raise Bad(f"{new_type} rebuilt by {brief(func)}, not by a tensor rebuild function")
        flags = type(state) in (dict, collections.OrderedDict) and set(state) <= PLAIN_TENSOR_STATE_KEYS
        if not (state is None or flags and all(type(v) is bool for v in state.values())):
            raise Bad(f"{new_type} with state {brief(state)}, not FSDP's _has_been_cloned flag")
        base = self.call(func, args)
        if not isinstance(base, TensorRef) or base.subclass:
            raise Bad(f"{new_type} rebuilt as a {brief(base)}, not a plain tensor")
        return base

    def _rebuild_wrapper_subclass(self, cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
        # torch pickles ShardedTensor and DTensor as an empty wrapper shell whose state comes afterwards.
        if cls is SubclassRef:
            qualname = SHARDED_TENSOR
        elif isinstance(cls, type) and issubclass(cls, Record):
            qualname = cls.qualname
        else:
            raise Bad(f"unexpected tensor subclass {brief(cls)}")
        if not isinstance(dtype, str):
            raise Bad(f"tensor subclass with dtype {brief(dtype)}")
        shape, strides = checked_dims("tensor size", size), checked_dims("tensor stride", stride)
        return SubclassRef(qualname, args=(dtype, shape, strides, storage_offset))

    def _getattr(self, owner, name):
        # Protocol 2 names a nested class as getattr(outer, name); only ShardedTensor.ProcessGroupState is allowed.
        if owner is SubclassRef and name == "ProcessGroupState":
            return ALLOWED["torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState"]
        raise UnsafePickleError(f"{self.source}: refuses getattr({brief(owner)}, {brief(name)}) (nothing was executed)")

    def find_class(self, module: Any, name: Any) -> Any:
        """The stand-in of the global ``module.name``; any global not in ``ALLOWED`` is refused."""
        if type(module) is not str or type(name) is not str:
            raise Bad("a global named by something other than strings")
        if module == "__builtin__":  # protocols 0-2 name builtins as Python 2 did (pickle maps them too)
            module = "builtins"
        qualname = f"{module}.{name}"
        try:
            return ALLOWED[qualname]
        except KeyError:
            raise UnsafePickleError(
                f"{self.source}: refuses to unpickle {printable(qualname, 120)}, which is not a checkpoint type "
                "(nothing was executed)"
            ) from None

    def persistent_load(self, pid: Any) -> StorageRef:
        """A storage of a ``torch.save`` archive, as its persistent id names it: ``('storage', storage_type, key,
        location, numel)``."""
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], DType)):
            raise Bad(f"unexpected persistent id {brief(pid)}")
        _, storage_dtype, key, _location, numel = pid
        if type(key) is int:
            key = str(key)
        if type(key) is not str or not key.isprintable() or len(key) > 256:
            raise Bad(f"storage key {brief(key)} is not a short name")
        numel = checked_count("storage size", numel)
        if numel * storage_dtype.itemsize >= SIZE_LIMIT:
            raise Bad(f"storage of {numel} elements is larger than torch can hold")
        return StorageRef(storage_dtype, key, numel)
