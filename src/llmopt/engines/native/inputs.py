"""The decode step's packed inputs kept from step to step, and a decode step in flight.

A decode step takes packed rows of [token, position, block table..., ring...] (`compiled.py`).
Building them as Python lists every step, 64 rows of a few dozen block ids each, and turning
those into a tensor was most of a large batch's host time per step. `PackedInputs` keeps them
instead, per (batch bucket, table width), in two host buffers (pinned on CUDA) used in turn,
each with a device twin, and writes only what changed since that buffer's last use:

- a row's token and position (every step, two vectorized writes for the whole batch);
- the block ids a sequence's table gained since then (a new block every `block_size` tokens);
- a whole row only where another sequence sits now, or the same one with a new table (after a
  swap-in); rows past the batch are zeroed once (padding points at scratch block 0).

Then one non-blocking copy moves the buffer to its device twin. Before the host writes a buffer
again it waits for the event recorded after that copy, two uses back, so in practice not at all.
The bookkeeping assumes what `blocks.BlockPool` guarantees: a sequence's table only grows at
its end while it decodes, and a table it gets anew (swap-in, re-admission) is a new list.

`arrange` gives the row order: a sequence keeps its row while it decodes, and the rows of those
that left are filled by newcomers, then by the last rows, so a finish rewrites one row, not
every row after it.

A token written as `-(j + 1)` (`carried`) stands for "the greedy token row j of the previous
decode step produced", which `CompiledSteps.carry` holds on the device: the overlapped path
(`generator.py`) launches step N+1 with those before step N's tokens are read back. `Flight` is
such a launched step: its rows and the host buffers its tokens are read back into.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["PackedInputs", "Flight", "arrange", "carried"]


def carried(row: int) -> int:
    """The packed token that stands for the previous step's greedy token of `row`."""
    return -(row + 1)


def arrange(prev: Sequence[Hashable], keys: Sequence[Hashable]) -> list[Hashable]:
    """Rows for `keys`: each key of `prev` still among them keeps its row; the rows of keys that
    left are taken by keys that joined (in their order), then by the last rows; joiners left
    over go at the end.

    >>> arrange(["a", "b", "c", "d"], ["a", "c", "d"])
    ['a', 'd', 'c']
    >>> arrange(["a", "b", "c"], ["c", "a", "x", "y"])
    ['a', 'x', 'c', 'y']
    """
    want = set(keys)
    if len(prev) == len(want) and want.issuperset(prev):
        return list(prev)
    old = set(prev)
    joined = [k for k in keys if k not in old]
    rows: list[Hashable | None] = [k if k in want else None for k in prev]
    j = 0
    for i, k in enumerate(rows):
        if k is None and j < len(joined):
            rows[i], j = joined[j], j + 1
    rows.extend(joined[j:])
    while None in rows:  # holes left: move the last rows into them
        last = rows.pop()
        if last is not None:
            rows[rows.index(None)] = last
    return rows  # type: ignore[return-value]


@dataclass
class _Row:
    seq: object  # the sequence's state object: identity says it is the same sequence
    table: list[int]  # its block table (the list itself: a new list is a new table)
    written: int  # how many of the table's blocks this buffer holds
    ring: list[int] | None


class _Buffer:
    """One packed (rows, width) host tensor, its device twin and what each row holds."""

    def __init__(self, rows: int, width: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.zeros(rows, width, dtype=torch.long, pin_memory=cuda)
        self.np = self.host.numpy()  # writes through numpy: no tensor op per element
        self.dev = torch.zeros(rows, width, dtype=torch.long, device=device) if cuda else self.host
        self.copied = torch.cuda.Event() if cuda else None
        self.used = False
        self.rows: list[_Row | None] = [None] * rows


class PackedInputs:
    """Persistent packed decode inputs, written incrementally (see the module doc)."""

    def __init__(self, device: torch.device, ring: int = 0):
        self.device, self.ring = device, int(ring)
        self._buffers: dict[tuple[int, int], list[_Buffer]] = {}
        self._turn: dict[tuple[int, int], int] = {}
        self.rewrites = 0  # whole rows written (a measure of the incremental path's work)

    def fill(
        self,
        rows: int,
        width: int,
        seqs: Sequence[object],
        tables: Sequence[list[int]],
        rings: Sequence[list[int]] | None,
        tokens: list[int],
        positions: list[int],
    ) -> torch.Tensor:
        """The device tensor (rows, 2 + width + ring) of these sequences' rows (the first
        len(seqs) rows; the rest padding), its host copy on its way."""
        key = (rows, width)
        pair = self._buffers.get(key)
        if pair is None:
            pair = self._buffers[key] = [_Buffer(rows, 2 + width + self.ring, self.device)]
            pair.append(_Buffer(rows, 2 + width + self.ring, self.device))
            self._turn[key] = 0
        buf = pair[self._turn[key]]
        self._turn[key] ^= 1
        if buf.copied is not None and buf.used:
            buf.copied.synchronize()  # its previous copy to the device has been read
        arr, held = buf.np, buf.rows
        b = len(seqs)
        for i in range(b):
            s, table, r = seqs[i], tables[i], held[i]
            if r is None or r.seq is not s or r.table is not table:
                ring = rings[i] if rings is not None else None
                arr[i, 2 : 2 + width] = 0
                arr[i, 2 : 2 + len(table)] = table
                if ring is not None:
                    arr[i, 2 + width :] = ring
                held[i] = _Row(s, table, len(table), ring)
                self.rewrites += 1
            elif len(table) > r.written:
                arr[i, 2 + r.written : 2 + len(table)] = table[r.written :]
                r.written = len(table)
        for i in range(b, rows):
            if held[i] is not None:
                arr[i] = 0
                held[i] = None
        arr[:b, 0] = tokens
        arr[:b, 1] = positions
        if buf.copied is not None:
            buf.dev.copy_(buf.host, non_blocking=True)
            buf.copied.record()
            buf.used = True
        return buf.dev


@dataclass
class Flight:
    """A decode step launched and not yet read back.

    `keys`: its sequences in the order their events are emitted; `rows`: the key of each row;
    `seqs`: each row's sequence state (identity, to tell a row whose sequence was removed and
    re-added under the same key); `tokens` / `logprobs`: host tensors its greedy tokens land in
    (pinned on CUDA, copied without blocking), ready once `done` (a CUDA event; None on the
    CPU, where the step has already run) has passed. `dead`: keys removed or swapped out since
    it was launched: their rows are computed and dropped.
    """

    keys: list[Hashable]
    rows: list[Hashable]
    seqs: list[object]
    tokens: torch.Tensor
    logprobs: torch.Tensor
    done: torch.cuda.Event | None
    row_of: dict[Hashable, int] = field(init=False)
    dead: set[Hashable] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.row_of = {k: i for i, k in enumerate(self.rows)}

    def row(self, key: Hashable, seqs: dict) -> int | None:
        """The row computing `key`'s next token, None where none does for the sequence it
        names now (not in this step, removed or swapped out since, or another under its key)."""
        i = self.row_of.get(key)
        if i is None or key in self.dead or seqs.get(key) is not self.seqs[i]:
            return None
        return i

    def covers(self, keys: Sequence[Hashable], seqs: dict) -> bool:
        """Whether each of `keys` has a row here (`row`)."""
        return all(self.row(k, seqs) is not None for k in keys)
