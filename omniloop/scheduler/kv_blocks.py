"""KV-cache block accounting by id only; the KV tensors themselves live in the runner.

A request owns a block table (a list of block ids, position ``p`` lives in block
``table[p // block_size]``). Tables are owned by the requests; the pool only hands out and takes back ids.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        """Whether ``grow(table, num_tokens)`` would succeed now."""
        return self.blocks_for(num_tokens) - len(table) <= len(self._free)

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend ``table`` to cover ``num_tokens`` positions; all or nothing (False leaves it unchanged)."""
        if not self.can_grow(table, num_tokens):
            return False
        table.extend(self._free.popleft() for _ in range(self.blocks_for(num_tokens) - len(table)))
        return True

    def free(self, table: list[int]) -> None:
        """Return every block of ``table`` and empty it, so freeing twice is harmless."""
        self._free.extend(table)
        table.clear()
