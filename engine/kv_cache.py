"""Paged KV-cache bookkeeping: a pool of fixed-size blocks with reference counts, and automatic
prefix caching keyed by a chained hash of each full block's token ids (tokens checked on a hit).

Blocks whose reference count drops to zero go to the back of the free queue but keep their
contents and hash, so a later request with the same prefix can take them back; allocation takes
from the front, evicting the least recently freed cached block first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceOf

from engine.sequence import Sequence


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "parent_id", "salt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.parent_id: int | None = None
        self.salt: str | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free_queue)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._uncache(block)
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def take(self, block_ids: SequenceOf[int]) -> None:
        """Adds a reference to cached blocks found by a prefix lookup."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1

    def release(self, block_ids: SequenceOf[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent_id: int | None,
               salt: str | None = None) -> int | None:
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids or block.parent_id != parent_id or block.salt != salt:
            return None
        return block_id

    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...], parent_id: int | None,
                 salt: str | None = None) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.token_ids, block.parent_id, block.salt = block_hash, token_ids, parent_id, salt
        self.cached[block_hash] = block_id

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids, block.parent_id, block.salt = None, (), None, None


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def root_hash(salt: str | None) -> int | None:
    """The parent of a sequence's first block: a salt (vLLM's cache_salt; the gateway gives each tenant
    its own) starts a chain that no other salt's blocks can match."""
    return None if salt is None else hash(("cache_salt", salt))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else root_hash(seq.prefix_salt)
            seq.block_hashes.append(chain_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq's tokens. At least one token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        self._update_hashes(seq, max_blocks * bs)
        found: list[int] = []
        parent_id: int | None = None
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block_id = self.pool.lookup(seq.block_hashes[i], tokens, parent_id, seq.prefix_salt)
            if block_id is None:
                break
            found.append(block_id)
            parent_id = block_id
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(found) * bs
        return found

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: SequenceOf[int] = ()) -> bool:
        """Makes room for num_new_tokens more tokens of seq (after its computed tokens and any cached
        prefix blocks it adopts). Returns False, changing nothing, when the pool is too small."""
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_ids) - len(cached_blocks)
        idle_cached = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_count == 0)
        if needed > self.pool.num_free - idle_cached:
            return False
        self.pool.take(cached_blocks)
        seq.block_ids.extend(cached_blocks)
        if needed > 0:
            seq.block_ids.extend(self.pool.allocate(needed))
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Registers seq's blocks that became full of computed tokens, so later requests can share them."""
        bs = self.block_size
        if not self.enable_prefix_caching or seq.num_computed_tokens // bs <= seq.num_registered_blocks:
            return
        # kept draft tokens count as computed a moment before they are appended to token_ids
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // bs, len(seq.block_ids))
        if num_full <= seq.num_registered_blocks:
            return
        self._update_hashes(seq, num_full * bs)
        for i in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_ids[i]
            if self.pool.blocks[block_id].block_hash is not None:
                continue
            parent_id = seq.block_ids[i - 1] if i else None
            self.pool.register(block_id, seq.block_hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs]), parent_id,
                               seq.prefix_salt)
        seq.num_registered_blocks = num_full

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Releases seq's blocks past those that num_tokens tokens fill (the slots of rejected draft tokens)."""
        keep = self.blocks_needed(num_tokens)
        if len(seq.block_ids) > keep:
            self.pool.release(list(reversed(seq.block_ids[keep:])))
            del seq.block_ids[keep:]

    def forget_cached_blocks(self) -> None:
        """Empties the prefix cache (the pool's contents are about to be lost: a sleeping engine frees it). Every
        block must be free: a block still held is a leak, raised here rather than carried across the sleep."""
        if self.num_used_blocks:
            raise RuntimeError(f"KV cache: {self.num_used_blocks} blocks are still held by finished requests")
        for block in self.pool.blocks:
            self.pool._uncache(block)
        self.pool.free_queue = OrderedDict((i, None) for i in range(self.num_blocks))

    def free(self, seq: Sequence) -> None:
        # the tail blocks go first into the free queue, so they are evicted before the shared prefix
        self.pool.release(list(reversed(seq.block_ids)))
        seq.block_ids = []
        seq.num_registered_blocks = 0
