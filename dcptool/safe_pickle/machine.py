"""The pickle machine: one flat loop over the opcodes, and the check of what it made.

Memo indices, string and byte lengths are checked against the pickle's size before anything is
allocated; what the opcodes ask beyond pushing values (calls, BUILD, keys) goes through
``calls.Calls``, its base, and the runs of records a caller declared through ``runs.Runs``.
"""

from __future__ import annotations

import codecs
import gc
import struct
from typing import Any, Callable

from dcptool.safe_pickle.allowlist import CONTAINERS, RECORD_TYPES, ArrayShell, Bad, Record, brief
from dcptool.safe_pickle.calls import BASE_ALLOWANCE, Calls
from dcptool.safe_pickle.runs import HOLE, LAZY, RecordRun, Runs, put_slot

MAX_LEVELS = 128  # levels of objects in a result (a record's attributes are one or two below it)
NODES_PER_BYTE = 16  # objects reachable from the result, shared containers counted where they appear
MAX_INT_BYTES = 1024  # integers larger than 8192 bits are no checkpoint field


def _number(text: bytes) -> int:
    """An integer written as text (protocol 0), at most ``MAX_INT_BYTES`` long."""
    if len(text) > 3 * MAX_INT_BYTES:
        raise Bad(f"an integer of {len(text):,} digits")
    value = int(text, 0)
    if value.bit_length() > 8 * MAX_INT_BYTES:
        raise Bad(f"an integer of more than {MAX_INT_BYTES} bytes")
    return value


def _frame_unpack(fmt: str) -> Callable:
    return struct.Struct(fmt).unpack_from


_U2, _U4, _U8 = (_frame_unpack(f) for f in ("<H", "<I", "<Q"))
_I4 = _frame_unpack("<i")
_F8 = _frame_unpack(">d")


class Machine(Calls):
    """One run of the restricted pickle machine over ``data``, with the runs of records a caller declared."""

    def __init__(self, data: bytes, source: str, declared: tuple[RecordRun, ...] = ()):
        super().__init__(data, source)
        self.runs = Runs(data, self.memo, declared)

    def memo_value(self, index: int) -> Any:
        """The object at a memo index: a run's object made now for a slot of a run, or an error for a hole."""
        value = self.runs.peek(index) if index >= 0 else HOLE
        if value is HOLE:
            raise Bad(f"memo index {index:,} was never set")
        if type(value) is ArrayShell:
            raise Bad("a numpy array used before its data")
        return self.runs.make(index) if value is LAZY else value

    def take(self, pos: int, count: int) -> bytes:
        """``count`` bytes from ``pos``, refused when the pickle is shorter (nothing is allocated first)."""
        if count < 0 or count > len(self.data) - pos:
            raise Bad(f"truncated: needs {count:,} bytes at byte {pos:,}, the pickle has {len(self.data) - pos:,} left")
        return self.data[pos:pos + count]

    def line(self, pos: int) -> bytes:
        """The text argument from ``pos`` to the end of its line (protocol 0 opcodes), without the newline."""
        stop = self.data.find(b"\n", pos)
        if stop < 0:
            raise Bad(f"truncated: a line at byte {pos:,} has no end")
        return self.data[pos:stop]

    def run(self) -> Any:
        """Interpret the pickle: the dispatch loop, one flat function with the frequent opcodes first, long on
        purpose (it runs once per opcode, and a function per opcode would add a call to each)."""
        data = self.data
        end = len(data)
        # The memo as a list (a dict would cost ten times the memory): ``HOLE`` marks indices never
        # set; PUT indices are bounded by the pickle's length, so holes cost O(N) at most.
        memo: list = self.memo
        filled = 0  # indices set: MEMOIZE puts at this one, as pickle does
        runs = self.runs
        starts = runs.starts  # classes whose memo reference may begin a declared run of records
        shift = 0  # memo slots kept as runs (runs.shift)
        lazy_from = end + 1  # the first memo index of a run: indices from there on go through runs.locate
        stack: list = []
        marks: list[list] = []
        pos = 0
        records = RECORD_TYPES
        while True:
            op = data[pos]  # IndexError past the end: load_bytes says "truncated"
            pos += 1
            if op == 0x94:  # MEMOIZE
                if filled == len(memo) + shift:
                    memo.append(stack[-1])
                    filled += 1
                else:
                    filled += runs.put(filled, stack[-1])
            elif op == 0x71:  # BINPUT
                index = data[pos]
                filled += put_slot(memo, index, stack[-1]) if index < lazy_from else runs.put(index, stack[-1])
                pos += 1
            elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                index = data[pos] if op == 0x68 else _U4(data, pos)[0]
                value = memo[index] if index < lazy_from else self.memo_value(index)  # IndexError: "unreadable"
                if value is HOLE:
                    value = self.memo_value(index)
                elif type(value) is type:
                    run = starts.get(value)  # maybe the first of a run of records the caller declared
                    found = run is not None and len(memo) + shift == filled and runs.read(pos - 1, run, self.charge)
                    if found:
                        pos, standing = found
                        shift = runs.shift
                        filled = len(memo) + shift
                        lazy_from = runs.first[0]
                        stack.extend(standing)
                        continue
                elif type(value) is ArrayShell:
                    value = self.memo_value(index)
                stack.append(value)
                pos += 1 if op == 0x68 else 4
            elif op == 0x4B:  # BININT1
                stack.append(data[pos])
                pos += 1
            elif op == 0x28:  # MARK
                marks.append(stack)
                stack = []
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x81:  # NEWOBJ
                args = stack.pop()
                cls = stack[-1]
                if type(cls) is type and cls in records and type(args) is tuple:
                    self.work += len(args)
                    if self.work > self.budget:
                        self.charge(0)
                    stack[-1] = cls.__new__(cls, *args)
                else:
                    stack[-1] = self.new_object(cls, args)
            elif op == 0x62:  # BUILD
                state = stack.pop()
                inst = stack[-1]
                if type(state) is dict and isinstance(inst, Record):
                    self.work += len(state)
                    if self.work > self.budget:
                        self.charge(0)
                    inst.__dict__.update(state)
                else:
                    stack[-1] = self.build(inst, state)
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
            elif op == 0x75:  # SETITEMS
                items = stack
                stack = marks.pop()
                target = stack[-1]
                if len(items) % 2 or not isinstance(target, dict):
                    raise Bad("SETITEMS with a key and no value" if len(items) % 2 else
                               f"sets items of a {brief(target)}, not of a dict")
                for i in range(0, len(items), 2):
                    key = items[i]
                    if type(key) is not str:
                        self.key(target, key)
                    target[key] = items[i + 1]
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                stack[-1] = self.call(stack[-1], args)
            elif op == 0x86:  # TUPLE2
                second = stack.pop()
                stack[-1] = (stack[-1], second)
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x8C:  # SHORT_BINUNICODE
                count = data[pos]
                text = data[pos + 1:pos + 1 + count]
                if len(text) != count:
                    self.take(pos + 1, count)
                pos += 1 + count
                stack.append(str(text, "utf-8", "surrogatepass"))
            elif op == 0x58:  # BINUNICODE
                count = _U4(data, pos)[0]
                text = self.take(pos + 4, count)
                pos += 4 + count
                stack.append(str(text, "utf-8", "surrogatepass"))
            elif op == 0x4D:  # BININT2
                stack.append(_U2(data, pos)[0])
                pos += 2
            elif op == 0x4A:  # BININT
                stack.append(_I4(data, pos)[0])
                pos += 4
            elif op == 0x74:  # TUPLE
                items = stack
                stack = marks.pop()
                stack.append(tuple(items))
            elif op == 0x5D:  # EMPTY_LIST
                stack.append([])
            elif op == 0x61:  # APPEND
                value = stack.pop()
                target = stack[-1]
                if type(target) is not list:
                    raise Bad(f"appends to a {brief(target)}, not to a list")
                target.append(value)
            elif op == 0x65:  # APPENDS
                items = stack
                stack = marks.pop()
                target = stack[-1]
                if type(target) is not list:
                    raise Bad(f"appends to a {brief(target)}, not to a list")
                target.extend(items)
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x87:  # TUPLE3
                third = stack.pop()
                second = stack.pop()
                stack[-1] = (stack[-1], second, third)
            elif op == 0x72:  # LONG_BINPUT
                index = _U4(data, pos)[0]
                pos += 4
                if index > end:
                    raise Bad(f"memo index {index:,} is beyond what a pickle of {end:,} bytes can hold")
                filled += runs.put(index, stack[-1])
            elif op == 0x93:  # STACK_GLOBAL
                name = stack.pop()
                stack[-1] = self.find_class(stack[-1], name)
            elif op == 0x63:  # GLOBAL
                module = self.line(pos)
                pos += len(module) + 1
                name = self.line(pos)
                pos += len(name) + 1
                stack.append(self.find_class(module.decode("utf-8"), name.decode("utf-8")))
            elif op == 0x51:  # BINPERSID
                stack[-1] = self.persistent_load(stack[-1])
            elif op == 0x8A:  # LONG1
                count = data[pos]
                stack.append(int.from_bytes(self.take(pos + 1, count), "little", signed=True))
                pos += 1 + count
            elif op == 0x47:  # BINFLOAT
                stack.append(_F8(data, pos)[0])
                pos += 8
            elif op == 0x95:  # FRAME: a buffering hint; its length must fit the pickle
                size = _U8(data, pos)[0]
                pos += 8
                if size > end - pos:
                    raise Bad(f"truncated: a frame of {size:,} bytes at byte {pos:,}, the pickle has {end - pos:,} left")
            elif op == 0x80:  # PROTO
                if data[pos] > 5:
                    raise Bad(f"pickle protocol {data[pos]} is unknown")
                pos += 1
            elif op == 0x2E:  # STOP
                return stack.pop()
            elif op == 0x8B:  # LONG4
                count = _I4(data, pos)[0]
                if count > MAX_INT_BYTES:
                    raise Bad(f"an integer of {count:,} bytes (at most {MAX_INT_BYTES})")
                stack.append(int.from_bytes(self.take(pos + 4, count), "little", signed=True))
                pos += 4 + count
            elif op == 0x6C:  # LIST
                items = stack
                stack = marks.pop()
                stack.append(items)
            elif op == 0x64:  # DICT
                items = stack
                stack = marks.pop()
                if len(items) % 2:
                    raise Bad("DICT with a key and no value")
                made: dict = {}
                for i in range(0, len(items), 2):
                    self.set_item(made, items[i], items[i + 1])
                stack.append(made)
            elif op == 0x73:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                self.set_item(stack[-1], key, value)
            elif op == 0x8F:  # EMPTY_SET
                stack.append(set())
            elif op == 0x90:  # ADDITEMS
                items = stack
                stack = marks.pop()
                target = stack[-1]
                if type(target) is not set:
                    raise Bad(f"adds items to a {brief(target)}, not to a set")
                self.add_items(target, items)
            elif op == 0x91:  # FROZENSET
                items = stack
                stack = marks.pop()
                made_set: set = set()
                self.add_items(made_set, items)
                stack.append(frozenset(made_set))
            elif op == 0x92:  # NEWOBJ_EX
                kwargs = stack.pop()
                args = stack.pop()
                if type(kwargs) is not dict:
                    raise Bad("NEWOBJ_EX keyword arguments are not a dict")
                stack[-1] = self.new_object(stack[-1], args, kwargs)
            elif op == 0x50:  # PERSID
                text = self.line(pos)
                pos += len(text) + 1
                stack.append(self.persistent_load(text.decode("ascii")))
            elif op == 0x30:  # POP
                if stack:
                    stack.pop()
                else:
                    stack = marks.pop()
            elif op == 0x31:  # POP_MARK
                stack = marks.pop()
            elif op == 0x32:  # DUP
                if type(stack[-1]) is ArrayShell:
                    raise Bad("a numpy array used before its data")
                stack.append(stack[-1])
            elif op == 0x43:  # SHORT_BINBYTES
                count = data[pos]
                stack.append(self.take(pos + 1, count))
                pos += 1 + count
            elif op == 0x42:  # BINBYTES
                count = _U4(data, pos)[0]
                stack.append(self.take(pos + 4, count))
                pos += 4 + count
            elif op == 0x8E or op == 0x96 or op == 0x8D:  # BINBYTES8, BYTEARRAY8, BINUNICODE8
                count = _U8(data, pos)[0]
                value = self.take(pos + 8, count)
                pos += 8 + count
                stack.append(bytearray(value) if op == 0x96 else str(value, "utf-8", "surrogatepass") if op == 0x8D
                             else value)
            elif op == 0x55:  # SHORT_BINSTRING (a Python 2 str)
                count = data[pos]
                stack.append(self.take(pos + 1, count).decode("ascii"))
                pos += 1 + count
            elif op == 0x54:  # BINSTRING
                count = _I4(data, pos)[0]
                stack.append(self.take(pos + 4, count).decode("ascii"))
                pos += 4 + count
            elif op == 0x53:  # STRING
                text = self.line(pos)
                pos += len(text) + 1
                if len(text) < 2 or text[0] != text[-1] or text[0] not in b"\"'":
                    raise Bad("the STRING opcode argument must be quoted")
                stack.append(codecs.escape_decode(text[1:-1])[0].decode("ascii"))
            elif op == 0x56:  # UNICODE
                text = self.line(pos)
                pos += len(text) + 1
                stack.append(str(text, "raw-unicode-escape"))
            elif op == 0x49:  # INT
                text = self.line(pos)
                pos += len(text) + 1
                stack.append(False if text == b"00" else True if text == b"01" else _number(text))
            elif op == 0x4C:  # LONG
                text = self.line(pos)
                pos += len(text) + 1
                stack.append(_number(text[:-1] if text.endswith(b"L") else text))
            elif op == 0x46:  # FLOAT
                text = self.line(pos)
                pos += len(text) + 1
                stack.append(float(text))
            elif op == 0x67:  # GET
                text = self.line(pos)
                pos += len(text) + 1
                index = _number(text)
                stack.append(self.memo_value(index))
            elif op == 0x70:  # PUT
                text = self.line(pos)
                pos += len(text) + 1
                index = _number(text)
                if not 0 <= index <= end:
                    raise Bad(f"memo index {index:,} is beyond what a pickle of {end:,} bytes can hold")
                filled += runs.put(index, stack[-1])
            elif op == 0x69:  # INST
                module = self.line(pos)
                pos += len(module) + 1
                name = self.line(pos)
                pos += len(name) + 1
                cls = self.find_class(module.decode("utf-8"), name.decode("utf-8"))
                items = stack
                stack = marks.pop()
                stack.append(self.call(cls, tuple(items)))
            elif op == 0x6F:  # OBJ
                items = stack
                stack = marks.pop()
                if not items:
                    raise Bad("OBJ without a class")
                stack.append(self.call(items[0], tuple(items[1:])))
            else:
                names = {0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER"}
                if op in names:
                    raise Bad(f"uses opcode {names[op]} at byte {pos - 1:,}, which checkpoints never use")
                raise Bad(f"unknown opcode {op:#04x} at byte {pos - 1:,}")

    def check(self, root: Any) -> None:
        """Refuse results that code walking them would choke on: cycles, deep nesting, exponential sharing.

        Walks the result level by level with ``gc.get_referents`` (C speed), counting shared containers
        at every place they appear, up to a budget proportional to the pickle's size; a cycle shows as
        nesting without end. A record's attributes are one level below it, its ``__dict__`` between.
        """
        limit = NODES_PER_BYTE * len(self.data) + BASE_ALLOWANCE
        containers = CONTAINERS
        level = [root] if type(root) in containers else []
        depth = total = 0
        while level:
            depth += 1
            if depth > MAX_LEVELS:
                raise Bad(f"nests objects more than {MAX_LEVELS} levels deep, or holds a reference cycle")
            found = gc.get_referents(*level)
            total += len(found)
            if total > limit:
                raise Bad(f"holds more than {limit:,} objects once shared containers are counted where they appear")
            level = [item for item in found if type(item) in containers]
