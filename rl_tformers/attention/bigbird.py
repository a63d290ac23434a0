"""Big Bird attention: sliding blocks + global tokens + random blocks (``bigbird``).

Zaheer et al. 2020, "Big Bird: Transformers for Longer Sequences", sec. 2 (the generalised
attention graph: r random keys per query, a window of w neighbours, g global tokens) and
appendix D (the blocked implementation); survey "The Transformer Family v2.0", "Combination of
Local and Global Context".

Blocked form, as in the paper's implementation: keys and queries are cut into blocks of
``block`` (b) absolute key indices. The queries of block i attend

- the ``window_blocks`` (3) blocks centred on i (sliding window),
- ``random_blocks`` (r) other blocks, drawn without replacement from the blocks outside the
  window (fixed per layer and length by ``seed``: the function a rollout sees is the one an
  update trains),
- the global tokens (Big Bird-ITC: existing tokens made global), which also attend every key.

The random part and the global part have **no causal form** (Big Bird's random graph links a
token to arbitrary positions), so the kind is bidirectional only; the backbone refuses it
causally and the Decision Transformer offers its last-action mode instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rl_tformers.attention._blocksparse import (
    BlockSparseAttention,
    HeadGroup,
    Heads,
    Piece,
    key_range,
    segment_indices,
    tile_blocks,
    with_globals,
)
from rl_tformers.attention.base import AttentionConfig, AttentionModule
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext


def random_blocks(
    q_blocks: Tensor, n_key_blocks: int, first_key_block: int, half: int, r: int, seed: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """r distinct random key blocks per query block, outside its window.

    Floyd's sampling of r distinct values from the admissible blocks, vectorised over query
    blocks (a loop over the r draws): O(N r^2) work and memory, no (N, S / b) table.

    Args:
        q_blocks: (N,) block index of each query block.
        n_key_blocks, first_key_block: the key blocks are ``first_key_block + arange(n_key_blocks)``.
        half: window half-width in blocks (blocks with |kb - qb| <= half are excluded).
        r: random blocks per query block.
        seed: the draw depends only on (seed, the block indices): deterministic.
    Returns:
        (N, r) long key block indices and (N, r) bool, False where fewer than r blocks were
        admissible (those draws are unused).
    """
    n = q_blocks.numel()
    gen = torch.Generator().manual_seed(int(seed))
    qb = q_blocks.cpu()
    last = first_key_block + n_key_blocks - 1
    lo_w = (qb - half).clamp(min=first_key_block)  # (N,) window blocks [lo_w, hi_w] within range
    hi_w = (qb + half).clamp(max=last)
    n_win = (hi_w - lo_w + 1).clamp(min=0)
    n_adm = n_key_blocks - n_win  # (N,) admissible blocks
    u = torch.full((n, r), -1, dtype=torch.long)  # ranks among the admissible blocks
    for i in range(r):  # Floyd: for m = n_adm - r + i, draw t in [0, m]; on a repeat take m
        m = n_adm - r + i
        t = (torch.rand(n, generator=gen) * (m + 1).clamp(min=1)).long()
        t = torch.where((u[:, :i] == t[:, None]).any(1), m, t)
        u[:, i] = torch.where(m >= 0, t, torch.full_like(t, -1))
    ok = u >= 0
    # rank -> block: below the window blocks as is, above them shifted past the window
    below = lo_w - first_key_block  # (N,) admissible blocks before the window
    blocks = torch.where(u < below[:, None], first_key_block + u, first_key_block + u + n_win[:, None])
    return blocks.clamp(min=0).to(device), ok.to(device)


class BigBirdAttention(BlockSparseAttention):
    """Big Bird (Zaheer et al. 2020, sec. 2 and app. D): window blocks + random blocks + globals.

    Shapes: N query blocks of b slots; the window piece gathers ``window_blocks * b`` keys,
    the random piece ``r * b`` keys per block: scores (B, H, N, b, (w + r) b), so
    O(S b (w + r)) plus O(T G + G S) for the global columns and rows. The random draw itself is
    (N, r) (Floyd's sampling, O(N r^2)).

    Cannot: causal masking, incremental decoding, dense weights. Random blocks are shared
    by all heads of a layer (the paper's implementation draws per head).
    """

    def __init__(self, ctx, position, block: int, window_blocks: int, random: int, global_tokens, seed: int) -> None:
        super().__init__(ctx, position)
        self.block, self.window_blocks, self.random = block, window_blocks, random
        self.global_tokens = tuple(global_tokens)
        self.seed = seed * 1_000_003 + max(self.layer_idx, 0) * 7919  # one pattern per layer

    def _random(self, q0: int, s: int, k0: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q_idx (N, b), starts (N,), random key blocks (N, r) and their validity (N, r)."""
        b = self.block
        q_idx, starts = tile_blocks(q0, s, b, device)
        first_kb = max(k0, 0) // b
        n_kb = (s - 1) // b - first_kb + 1
        # reduced mod 2^63: a large attention.seed (times 1_000_003) overflowed torch's seed range in
        # the first forward ("Overflow when unpacking long long"); seeds below 2^63 are unchanged
        seed = (self.seed + 31 * first_kb + 7 * n_kb) % 2**63
        blocks, ok = random_blocks(starts // b, n_kb, first_kb, self.window_blocks // 2, self.random, seed, device)
        return q_idx, starts, blocks, ok

    def groups(self, h: Heads, x_q: Tensor) -> list[HeadGroup]:
        b, half = self.block, self.window_blocks // 2
        q_idx, starts, blocks, ok = self._random(h.q0, h.n_k, h.k0, h.q.device)
        window = Piece(q_idx, key_range(starts, -half * b, (half + 1) * b))  # (N, w b)
        k_rand = (blocks[:, :, None] * b + torch.arange(b, device=h.q.device)).reshape(blocks.shape[0], -1)  # (N, r b)
        k_ok = ok[:, :, None].expand(-1, -1, b).reshape(blocks.shape[0], -1)  # (N, r b)
        rand = Piece(q_idx, k_rand, k_ok=k_ok)
        g_abs = segment_indices(self.global_tokens, h.n_q, h.q0, h.q.device)
        # window, random and global columns share the query tiling (one softmax); the global
        # rows cover only the global queries, which the others exclude
        return [HeadGroup(None, with_globals(h, [window, rand], g_abs), disjoint=True)]

    def pattern(self, ctx: AttnContext) -> Tensor:
        dev = ctx.pos_q.device
        b, half, s, q0 = self.block, self.window_blocks // 2, ctx.k_len, ctx.prefix_len
        a = torch.arange(ctx.q_len, device=dev)[:, None] + q0  # (T, 1)
        j = torch.arange(s, device=dev)[None, :]  # (1, S)
        qb, kb = a // b, j // b
        window = (kb - qb).abs() <= half  # (T, S)
        _, starts, blocks, ok = self._random(q0, s, 0, dev)
        row = qb[:, 0] - starts[0] // b  # (T,) query block -> row of the draw
        chosen = blocks.masked_fill(~ok, -1)[row]  # (T, r)
        rand = (kb[:, :, None] == chosen[:, None, :]).any(-1)  # (T, S)
        g = segment_indices(self.global_tokens, ctx.q_len, q0, dev)
        is_g = torch.zeros(s, dtype=torch.bool, device=dev)
        is_g[g] = True
        glob = is_g[None, :] | is_g[q0:][:, None]
        return (window | rand | glob)[None, None]  # (1, 1, T, S)


@ATTENTION.register(
    "bigbird",
    description="Big Bird: window blocks + random blocks + global tokens (blocked); bidirectional only",
    paper="Zaheer et al. 2020, Big Bird: Transformers for Longer Sequences (sec. 2, app. D)",
    capabilities=Capabilities(
        causal=False, bidirectional=True, key_padding=True, memory=True, incremental=False, exact=True, subquadratic=True,
        cross_attention=False,  # queries are the last T of the S keys: more queries than keys fail
    ),
)
@dataclass(frozen=True)
class BigBirdConfig(AttentionConfig):
    """``block``: b; ``window_blocks``: w, odd (3 in the paper); ``random_blocks``: r (3 in
    the paper); ``global_tokens``: segment indices of the global tokens (negative = from the
    end; the paper's ITC uses 2 blocks); ``seed``: of the per-layer random draw."""

    block: int = 8
    window_blocks: int = 3
    random_blocks: int = 2
    global_tokens: tuple[int, ...] = (0,)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block < 1 or self.random_blocks < 0:
            raise ValueError(f"attention.block must be >= 1 and random_blocks >= 0, got {self.block}, {self.random_blocks}")
        if self.window_blocks < 1 or self.window_blocks % 2 == 0:
            raise ValueError(f"attention.window_blocks must be a positive odd number, got {self.window_blocks}")

    @classmethod
    def bench_config(cls, length: int) -> dict:
        """Benchmark values: the paper's blocks of 64, 3 window and 3 random blocks, one global token."""
        return {"block": 64, "window_blocks": 3, "random_blocks": 3, "global_tokens": (0,)}

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Test values: blocks of 2 with one random block (sparse at the suite's 12 tokens)."""
        return {"block": 2 if seq_len < 64 else 16, "random_blocks": 1}

    def build(self, ctx, position) -> AttentionModule:
        return BigBirdAttention(
            ctx, position, self.block, self.window_blocks, self.random_blocks, tuple(self.global_tokens), self.seed
        )
