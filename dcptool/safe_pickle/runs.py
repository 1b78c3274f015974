"""Runs of like records read as columns (the hook that makes pickles of a million records fast), and the memo.

A pickle of a million small records (the ``.metadata`` of a checkpoint saved by a thousand ranks) is a
million Python objects and tens of millions of opcodes. CPython's pickler (protocols 4 and 5) writes
every record of one class the same way, so a caller of ``load_bytes`` declares the records it expects
by the hundred thousand (``RecordLayout``: a class and its attributes' kinds) and what stands for a
run of them (``RecordRun``). The machine then recognizes a run one item at a time by a regular
expression (C speed), gives the run's fields to ``RecordRun.stand_in`` as columns (``Columns``: numpy
arrays, a few machine integers per record) and pushes what that returns in place of the records. An
item that differs in any way (other references, text the expression does not cover) ends the run and
goes through the ordinary opcodes, as every record does when no run is declared.

The memo slots the records would have filled are kept as the run's index range, not as list entries
(8 bytes a slot is hundreds of MB at millions of records): the memo list holds the other slots,
shifted down past the runs (``Runs.locate``), and an opcode that refers to a slot of a run gets its
object made then (``Runs.make``).
"""

from __future__ import annotations

import array
import bisect
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from dcptool.safe_pickle.allowlist import ALLOWED, record

TEXT, INT, DIMS = "text", "int", "dims"  # the kinds of attribute a run reads as columns
HOLE = object()  # a memo index never set
LAZY = object()  # a memo slot of a run, its object not made yet


def put_slot(memo: list, index: int, value: Any) -> int:
    """``memo[index] = value``, growing the list with holes; returns 1 when the index was not set before.
    The caller has bounded ``index`` by the pickle's length."""
    if index < len(memo):
        new = memo[index] is HOLE
        memo[index] = value
        return int(new)
    memo.extend([HOLE] * (index - len(memo)))
    memo.append(value)
    return 1


@dataclass(frozen=True)
class RecordLayout:
    """A record as CPython's pickler writes an object rebuilt by ``cls.__new__(cls)`` with a dict state: its
    class (``qualname``, a record class of the allowlist), then each attribute's name and value in the
    order of ``fields``, each ``(name, kind)``: ``TEXT`` a str, ``INT`` an int, ``DIMS`` a ``torch.Size`` of
    one to three integers."""

    qualname: str
    fields: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Columns:
    """The fields of the first ``count`` items of a run: ``fields[i]`` holds those of the run's ``layouts[i]``
    by attribute name, ``TEXT`` as a list of str, ``INT`` as an int64 array, ``DIMS`` as ``(values, ndim)``:
    ``(items, 3)`` int64 (missing dims 0) and how many dims each has (uint8). A column may hold more than ``count``."""

    count: int
    fields: tuple[dict[str, Any], ...]


class RecordRun:
    """A fast path a caller of ``load_bytes`` declares: items of ``layouts`` one after another (one record: a
    list's items; two: a dict's keys and values), read as columns.

    ``stand_in(columns)`` returns what is pushed in place of the items (one object for a list's items, a key
    and a value for a dict's) and how many of the first items it stands for (0: none, they are read the
    ordinary way). The stand-ins are the caller's: the result holds them where the records would be, and the
    machine never looks inside them.
    """

    def __init__(self, layouts: tuple[RecordLayout, ...], stand_in: Callable[[Columns], tuple[tuple, int]]):
        self.layouts, self.stand_in = tuple(layouts), stand_in
        self.start = ALLOWED[self.layouts[0].qualname]  # a memo reference to this class may begin a run
        self.texts = [(number, name) for number, layout in enumerate(self.layouts)
                      for name, kind in layout.fields if kind == TEXT]
        # A record as parts of an expression: bytes as they are; "ref": a memo reference (the class, an
        # attribute's name, torch.Size) that a run's first item checks and the rest repeat byte for byte;
        # (kind, (record number, name)): a field. ``refs``: what the references must be, in order.
        self.parts: list = []
        self.refs: list = []
        for number, layout in enumerate(self.layouts):
            self.parts += ["ref", _NEW]
            self.refs.append(self.start if number == 0 else ALLOWED[layout.qualname])
            for name, kind in layout.fields:
                if kind not in (TEXT, INT, DIMS):
                    raise ValueError(f"{layout.qualname}.{name}: kind {kind!r} is not TEXT, INT or DIMS")
                self.parts.append("ref")
                self.refs.append(name)
                if kind == DIMS:
                    self.parts.append("ref")
                    self.refs.append(ALLOWED["torch.Size"])
                self.parts.append((kind, (number, name)))
            self.parts.append(_SETITEMS_BUILD)
        # The MEMOIZE opcodes of an item but its literal texts': per record, itself and its state, three per torch.Size.
        self.slots = sum(2 + 3 * sum(kind == DIMS for _, kind in layout.fields) for layout in self.layouts)
        self.patterns: dict = {}  # (references, text shape) -> (expression, groups by field); bounded below

    def pattern(self, refs: tuple | None = None, shape: tuple | None = None) -> tuple[re.Pattern, dict]:
        """An item's expression and where its fields are among the groups. Without ``refs``, any item of these
        layouts (to learn a run's shape from its first item); with ``refs`` (the first item's reference bytes)
        and ``shape`` (per text field, whether it is literal text rather than a memo reference), only items
        exactly like the first."""
        key = (refs, shape)
        found = self.patterns.get(key)
        if found:
            return found
        pieces, fields, group = [], {}, 0
        refs_left, literal = iter(refs or ()), iter(shape or ())
        for part in self.parts:
            if isinstance(part, bytes):
                pieces.append(part)
                continue
            if part == "ref":
                piece, count, name = (b"(" + re.escape(next(refs_left)) + b")" if refs else _GET), 1, "refs"
            else:
                kind, name = part
                if kind == INT:
                    piece, count = _INT, 1
                elif kind == DIMS:  # 1 to 3 integers (items of one run may differ: 2-D weights and 1-D norms)
                    piece, count = _INT + _OPT + _OPT + rb"([\x85-\x87])" + _SIZE_END, 4
                elif shape is None:
                    piece, count = rb"(h.|j.{4}|" + _LITERAL + b")", 3
                else:
                    piece, count = (_LITERAL, 2) if next(literal) else (_GET, 1)
            fields.setdefault(name, []).extend(range(group, group + count))
            pieces.append(piece)
            group += count
        found = (re.compile(b"".join(pieces), re.DOTALL), fields)
        if len(self.patterns) < 256:
            self.patterns[key] = found
        return found


_GET = rb"(h.|j.{4})"  # BINGET, LONG_BINGET
_INT = (rb"(K.|M..|J.{4}|\x8a\x01.|\x8a\x02..|\x8a\x03.{3}|\x8a\x04.{4}|\x8a\x05.{5}|\x8a\x06.{6}|"
        rb"\x8a\x07.{7}|\x8a\x08.{8})")  # BININT1, BININT2, BININT, LONG1 of up to 8 bytes
_OPT = b"(" + _INT[1:-1] + b")?"
_NEW = rb"\)\x81\x94}\x94\("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK, then the state's items
_SETITEMS_BUILD = b"ub"
_SIZE_END = rb"\x94\x85\x94R\x94"  # MEMOIZE TUPLE1 MEMOIZE REDUCE MEMOIZE: torch.Size(tuple)
# SHORT_BINUNICODE, memoized; text holding the MEMOIZE byte (some UTF-8) goes the ordinary way, so a
# match never reaches past the record's own MEMOIZE (into a FRAME, say)
_LITERAL = rb"\x8c(.)([^\x94]{0,255})\x94"
_U4 = struct.Struct("<I").unpack_from


def ints(codes: tuple | list) -> np.ndarray:
    """The values of BININT1 / BININT2 / BININT / LONG1 opcodes with their arguments (b"": 0), as int64."""
    raw = np.array(codes, dtype="S10").view(np.uint8).reshape(-1, 10).astype(np.int64)
    values = raw[:, 1] | raw[:, 2] << 8  # BININT1 (padded with a zero) and BININT2
    wide = np.flatnonzero((raw[:, 0] == 0x4A) | (raw[:, 0] == 0x8A))  # BININT and LONG1
    if len(wide):
        rest = raw[wide]
        word = rest[:, 1] | rest[:, 2] << 8 | rest[:, 3] << 16 | rest[:, 4] << 24
        word = np.where(word >= 1 << 31, word - (1 << 32), word)
        count = rest[:, 1]
        long = np.zeros(len(rest), np.int64)
        for byte in range(8):
            long |= rest[:, 2 + byte] << (8 * byte)
        top = rest[np.arange(len(rest)), np.minimum(count + 1, 9)]  # LONG1's last byte holds the sign
        negative = (count > 0) & (count < 8) & (top >= 128)  # eight bytes wrapped into int64 are signed already
        long = np.where(negative, long - np.left_shift(np.int64(1), 8 * np.minimum(count, 7)), long)
        values[wide] = np.where(rest[:, 0] == 0x4A, word, long)
    return values


def dims_column(columns: list, groups: list[int], count: int) -> tuple[np.ndarray, np.ndarray]:
    """A torch.Size field of the first ``count`` items: ``(items, 3)`` integers (missing dims 0) and how many
    dims each has (uint8: a run's columns are kept while the pickle is read, a million records of them)."""
    values = [ints([code or b"" for code in columns[g][:count]]) for g in groups[:3]]
    ndim = np.frombuffer(b"".join(columns[groups[3]][:count]), np.uint8) - np.uint8(0x84)
    return np.stack(values, axis=1), ndim


def _memo_index(code: bytes) -> int:
    return code[1] if code[0] == 0x68 else _U4(code, 1)[0]


class Runs:
    """The runs of records one pickle held, and the memo slots they stand for.

    ``memo`` is the machine's memo list: memo indices past a run are its positions shifted by the slots of
    the runs before them. ``declared``: the runs the caller of ``load_bytes`` expects.
    """

    def __init__(self, data: bytes, memo: list, declared: tuple[RecordRun, ...]):
        self.data, self.memo = data, memo
        self.starts = {run.start: run for run in declared}  # a class -> the run a memo reference to it may begin
        self.first = array.array("q")  # per run: its first memo index
        self.real = array.array("q")  # per run: where the memo list continues after it
        self.size = array.array("q")  # per run: its memo slots
        self.held: list[tuple[RecordRun, Columns, tuple, int]] = []  # per run: declared, columns, shape, slots per item
        self.shift = 0  # memo slots of all runs (memo index = list position + the slots of the runs before)
        self.made: dict[int, Any] = {}  # slots of runs referred to (made then) or PUT again
        self.strings: dict[bytes, str] = {}  # texts of items, decoded once

    def read(self, pos: int, run: RecordRun, charge: Callable[[int], None]) -> tuple[int, tuple] | None:
        """Items of ``run`` from ``pos`` (a memo reference to its first class) on, kept as columns while they are
        like the first; returns the position after them and what stands for them on the stack, or None.
        Called only where every memo slot so far is set (the runs' slots then follow the list's end); the work
        goes to ``charge`` (the machine's, not kept: a machine and its runs referring to each other would be
        a cycle, its memo freed only by the next garbage collection)."""
        data, memo = self.data, self.memo
        generic, fields = run.pattern()
        first = generic.match(data, pos)
        if first is None:
            return None
        groups = first.groups()
        refs = tuple(groups[g] for g in fields["refs"])
        for code, want in zip(refs, run.refs):
            value = self.peek(_memo_index(code))
            if not (type(value) is str and value == want if type(want) is str else value is want):
                return None
        shape = tuple(groups[fields[name][1]] is not None for name in run.texts)
        if (refs, shape) not in run.patterns:
            charge(4096)  # compiling an expression: a pickle of many different runs pays for each
        pattern, fields = run.pattern(refs, shape)
        match, rows, starts, end = pattern.match, [], [], pos
        found = match(data, end)
        while found is not None:
            starts.append(end)
            rows.append(found.groups())
            end = found.end()
            found = match(data, end)
        if not rows:
            return None
        columns = list(zip(*rows))
        count = len(rows)
        values: tuple[dict[str, Any], ...] = tuple({} for _ in run.layouts)
        for number, name in run.texts:
            values[number][name], count = self.texts(columns, fields[(number, name)], count)
        for number, layout in enumerate(run.layouts):
            for name, kind in layout.fields:
                if kind == INT:
                    values[number][name] = ints(columns[fields[(number, name)][0]][:count])
                elif kind == DIMS:
                    values[number][name] = dims_column(columns, fields[(number, name)], count)
        table = Columns(count, values)
        standing, count = run.stand_in(table) if count else ((), 0)
        if count == 0:
            return None
        end = starts[count] if count < len(rows) else end
        slots = run.slots + sum(shape)  # a literal text is memoized too
        charge((end - pos) >> 3)
        self.first.append(len(memo) + self.shift)
        self.real.append(len(memo))
        self.size.append(slots * count)
        self.held.append((run, table, shape, slots))
        self.shift += slots * count
        return end, standing

    def texts(self, columns: list, groups: list[int], count: int) -> tuple[list[str], int]:
        """A text field of the first ``count`` items, and how many of them are well formed."""
        memo = self.memo
        if len(groups) == 1:  # memo references: each must be a string
            raw = np.array(columns[groups[0]][:count], dtype="S5").view(np.uint8).reshape(-1, 5).astype(np.int64)
            indices = np.where(raw[:, 0] == 0x68, raw[:, 1], raw[:, 1] | raw[:, 2] << 8 | raw[:, 3] << 16 | raw[:, 4] << 24)
            real = self.list_positions(indices)
            if len(real) and real.max() >= len(memo):
                count = int(np.argmax(real >= len(memo)))
            made = self.made  # -1: a slot of a run
            values = [memo[r] if r >= 0 else made.get(i, LAZY) for r, i in zip(real[:count].tolist(), indices.tolist())]
            if set(map(type, values)) - {str}:
                count = next(i for i, value in enumerate(values) if type(value) is not str)
            return values[:count], count
        lengths, texts = columns[groups[0]][:count], columns[groups[1]][:count]
        wrong = np.flatnonzero(np.frombuffer(b"".join(lengths), np.uint8) != np.fromiter(map(len, texts), np.int64, count))
        count = int(wrong[0]) if len(wrong) else count  # text holding the MEMOIZE byte: not this item's shape
        strings = self.strings  # one object per distinct text (a tensor's name recurs once per rank)
        for text in set(texts[:count]) - strings.keys():
            strings[text] = str(text, "utf-8", "surrogatepass")
        return list(map(strings.__getitem__, texts[:count])), count

    def locate(self, index: int) -> tuple[int, int]:
        """Where memo slot ``index`` is: ``(list position, -1)``, or ``(-1, run)`` for a slot of a run."""
        run = bisect.bisect_right(self.first, index) - 1
        if run < 0:
            return index, -1
        inside, size = index - self.first[run], self.size[run]
        return (-1, run) if inside < size else (self.real[run] + inside - size, -1)

    def list_positions(self, indices: np.ndarray) -> np.ndarray:
        """``locate`` of many memo indices at once: list positions, -1 for slots of runs."""
        if not self.held:
            return indices
        first, real_at = np.frombuffer(self.first, np.int64), np.frombuffer(self.real, np.int64)
        sizes = np.frombuffer(self.size, np.int64)
        run = np.maximum(np.searchsorted(first, indices, side="right") - 1, 0)
        inside = indices - first[run]
        before = indices < first[0]
        positions = np.where(before, indices, real_at[run] + inside - sizes[run])
        positions[~before & (inside < sizes[run])] = -1
        return positions

    def peek(self, index: int) -> Any:
        """What memo slot ``index`` holds, without making a run's object: ``HOLE``, ``LAZY`` or the value."""
        position, run = self.locate(index)
        if run >= 0:
            return self.made.get(index, LAZY)
        return self.memo[position] if position < len(self.memo) else HOLE

    def put(self, index: int, value: Any) -> int:
        """PUT at a memo index (``put_slot`` past the runs); returns 1 when the index was not set before."""
        position, run = self.locate(index)
        if run >= 0:
            self.made[index] = value
            return 0
        return put_slot(self.memo, position, value)

    def make(self, index: int) -> Any:
        """The object at memo slot ``index`` of a run (``peek`` gave ``LAZY``), made now with the rest of its
        item's slots, and kept: later references get the same objects."""
        number = bisect.bisect_right(self.first, index) - 1
        run, table, shape, slots = self.held[number]
        row, slot = divmod(index - self.first[number], slots)
        for offset, value in enumerate(_slot_values(run, table, shape, row)):
            self.made.setdefault(index - slot + offset, value)
        return self.made[index]


def _slot_values(run: RecordRun, columns: Columns, shape: tuple, row: int) -> list:
    """What the memo slots of item ``row`` hold, in order: per record, itself and its state, then per field
    in order its literal text, or a torch.Size's tuple, its 1-tuple and the Size (a tuple here)."""
    values, literal = [], iter(shape)
    for layout, fields in zip(run.layouts, columns.fields):
        state, memoized = {}, []
        for name, kind in layout.fields:
            if kind == TEXT:
                value = fields[name][row]
                if next(literal):
                    memoized.append(value)
            elif kind == INT:
                value = int(fields[name][row])
            else:
                dims, ndim = fields[name]
                value = tuple(dims[row, :ndim[row]].tolist())
                memoized += [value, (value,), value]
            state[name] = value
        values += [record(layout.qualname, state), state, *memoized]
    return values
