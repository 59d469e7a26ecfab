"""Paged KV cache: a pool of fixed-size blocks and per-request block tables.

Verb pairs: `can_allocate / allocate / free` on the pool; `can_append / append_slots` on a
table. The pool owns the tensors; a table is just the ordered block ids of one request.
`check_integrity()` asserts that every block is either free or owned by exactly one table.
"""

from __future__ import annotations

import torch

from cells.engine.embedded.model_spec import ModelSpec


class BlockPool:
    """Fixed pool of KV blocks: k/v tensors [layers, num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.device = torch.device(device)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def bytes_per_block(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    @staticmethod
    def block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block (keys and values, every layer) before a pool exists."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation -------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, owner: str, num_blocks: int) -> list[int]:
        """Append `num_blocks` fresh blocks to `owner`'s table (created if new)."""
        assert self.can_allocate(num_blocks), "caller must check can_allocate first"
        got = [self._free.pop() for _ in range(num_blocks)]
        self.tables.setdefault(owner, []).extend(got)
        return got

    def free(self, owner: str) -> int:
        """Return all of `owner`'s blocks to the pool; returns how many. Unknown owner: 0."""
        blocks = self.tables.pop(owner, [])
        self._free.extend(reversed(blocks))
        return len(blocks)

    def can_append(self, owner: str, num_tokens: int) -> bool:
        """Whether `owner` can grow to hold `num_tokens` tokens."""
        need = self.blocks_for(num_tokens) - len(self.tables.get(owner, ()))
        return need <= 0 or self.can_allocate(need)

    def append_slots(self, owner: str, num_tokens: int) -> None:
        """Grow `owner`'s table to hold `num_tokens` tokens (caller checked can_append)."""
        need = self.blocks_for(num_tokens) - len(self.tables.get(owner, ()))
        if need > 0:
            self.allocate(owner, need)

    # -- data -------------------------------------------------------------------------------
    def slots(self, owner: str, start: int, end: int) -> torch.Tensor:
        table = self._ids(self.tables[owner])
        pos = torch.arange(start, end, device=self.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kf = self.k[layer].view(-1, *self.k.shape[3:])
        vf = self.v[layer].view(-1, *self.v.shape[3:])
        kf.index_copy_(0, slots, k)
        vf.index_copy_(0, slots, v)

    def read(self, layer: int, owner: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions [0, length) of `owner`, contiguous [length, kv_heads, dim]."""
        nb = self.blocks_for(length)
        ids = self._ids(self.tables[owner][:nb])
        k = self.k[layer].index_select(0, ids).flatten(0, 1)[:length]
        v = self.v[layer].index_select(0, ids).flatten(0, 1)[:length]
        return k, v

    def export_blocks(self, owner: str, start: int, end: int) -> torch.Tensor:
        """Copy of blocks [start, end) of `owner`'s table: [2, layers, n, block, kv_heads, dim].
        Does not modify the cache."""
        ids = self._ids(self.tables[owner][start:end])
        out = torch.empty((2, self.k.shape[0], len(ids), *self.k.shape[2:]), dtype=self.k.dtype, device=self.k.device)
        torch.index_select(self.k, 1, ids, out=out[0])  # one copy each, straight into place
        torch.index_select(self.v, 1, ids, out=out[1])
        return out

    def import_blocks(self, owner: str, start: int, data: torch.Tensor) -> None:
        """Write exported blocks into table positions [start, start+n) of `owner`."""
        n = data.shape[2]
        ids = self._ids(self.tables[owner][start : start + n])
        if ids.numel() != n:
            raise ValueError(f"{owner}: table holds {len(self.tables[owner])} blocks, import needs {start + n}")
        self.k.index_copy_(1, ids, data[0])
        self.v.index_copy_(1, ids, data[1])

    def check_integrity(self) -> None:
        owned = [b for t in self.tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(self._free), "a block is both owned and free"
        assert len(owned) + len(self._free) == self.num_blocks, "blocks leaked"
        assert len(set(self._free)) == len(self._free), "a block is free twice"


class PagedSink:
    """KVSink of one request segment: writes positions [start, start+n), reads [0, start+n)."""

    __slots__ = ("pool", "owner", "start", "end", "slots")

    def __init__(self, pool: BlockPool, owner: str, start: int, end: int):
        self.pool, self.owner, self.start, self.end = pool, owner, start, end
        self.slots = pool.slots(owner, start, end)

    def store_and_load(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.pool.write(layer, self.slots, k, v)
        return self.pool.read(layer, self.owner, self.end)
