"""The symmetric workspace of one SM90 GC-MoE layer: its typed region table and the host twins of its arithmetic.

One allocation per layer (`gc_moe.runtime.workspace`), the same offsets on every rank:

| group | region | dtype, shape | written by | read by |
| --- | --- | --- | --- | --- |
| inputs | x, x_sf, topk_idx, topk_weights | fp8 [C, H], int32 [C, H/128], int64 [C, k], f32 [C, k] | caller | role1 (peers pull) |
| routing | send_count | int64 [E] | role1 (local packed atomics) | role1 block 0 |
| routing | recv_count | int64 [2, P, e] | role1 of every source (peer store) | role1 pull, role3 |
| routing | src_index | int32 [P, e, C k] | role1 of every source (peer store) | role1 pull |
| token ring | ring_act, ring_scale | fp8 [R, H], f32 [R, H/128] | role1 pull | role2 W1 |
| token ring | routing_weight, dest_row, ring_source | f32 [N], int32 [N], int32 [N] | role1 pull | role2 |
| token ring | expert_offsets | int32 [e + 1] | role1 block 0 | role2 |
| L2 input | l2_act, l2_scale | fp8 [R, I], f32 [R, I/128] | role2 W1 | role2 W2 |
| combine | combine | bf16 [k + 1, C, H] | role2 W2 of every owner (lane k: shared) | role3 |
| signals | l1_full_count, l1_empty_count, l2_empty_count | int32 [B] | role1 / role2 | role2 / role1 |
| signals | w1_done_mask | int64 [e, C P / 8] | role2 W1 (bit per finished unit) | role2 W2 |
| signals | tag1_arrive, combine_ready | int32 [2] each | peers (release, system scope) | role1 / role3 |
| signals | control | int32 [CONTROL_WORDS] | roles 1 and 3 | roles 1 and 3 |
| signals | peers | int64 [MAX_PEERS] | host once | roles 1 and 3 |

C = capacity (tokens per rank), E experts, e = E/P local experts, B ring blocks of BM rows, R = B BM ring rows,
N = the pool's rows (the most grouped rows one replay can bring, C P min(k, e), in whole blocks).
Grouped row r of this replay (experts in order, within an expert the source ranks in order) lives in ring row
r mod R; its logical pool block L = r // BM sits in ring block L mod B with generation L // B, and is full
when l1_full_count of that ring block reaches BM (generation + 1). By default B covers the pool (every
generation is 0 within a replay); `ring_blocks_limit` bounds it (ring reuse): role1 then waits before a row of
generation g >= 1 until the ring block's l1_empty_count reaches g BM w1_ctas (every W1 CTA adds the rows of its
tile it read); W1's output rows (L2 input) form a ring of the same R rows, which W1 refills once l2_empty_count
reaches g BM w2_ctas (W2 CTAs release the rows they read); the routing words stay pool-sized. Role3 resets every
ring signal for the next replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gc_moe.runtime.workspace import MAX_PEERS, Region, WorkspaceLayout

K128 = 128
# control words (int32) of the `control` region
RECV_PARITY = 0  # parity of recv_count / combine_ready this replay uses; role3 flips it
BARRIER_PHASE = 1  # tag-1 barrier phase; role1 flips it after passing
DISPATCH_SYNC = 2  # role1's grid-sync arrivals this replay; role3 resets it
RING_READY = 3  # 1 once role1 wrote expert_offsets (release); role3 resets it
FINALIZE_DONE = 4  # role3 CTAs done; the last one flips the parity and resets it
ARRIVAL_ERRORS = 5  # cumulative: receive counts whose contributor count was not the dispatch grid
RECEIVED_ROWS = 6  # cumulative: grouped rows received (statistics)
RING_OVERFLOWS = 7  # cumulative: replays whose grouped rows exceeded the ring (rows past it are dropped)
REPLAYS = 8  # cumulative: replays finalized
ROLE2_TICKET = 9  # the fused role2 kernel's next unit; the CTA that draws the last ticket resets it
CONTROL_WORDS = 16
PACKED_CONTRIBUTOR = 1 << 32  # high word of a packed count: one dispatch CTA's contribution


@dataclass(frozen=True)
class LayerShape:
    """The compile- and allocation-time shape of one layer on one rank."""

    num_ranks: int
    num_experts: int
    topk: int
    hidden: int
    intermediate: int
    capacity: int  # tokens per rank
    block_m: int  # ring block rows (the grouped GEMM's block_n)
    num_shared_experts: int = 0
    # 0: the ring covers the pool (no reuse within a replay); else at most this many blocks, reused by generation
    # (at least min_reuse_ring_blocks(block_m): see there)
    ring_blocks_limit: int = 0

    def __post_init__(self):
        problems = []
        for name in ("num_ranks", "num_experts", "topk", "hidden", "intermediate", "capacity", "block_m"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                problems.append(f"{name}: got {v!r}; allowed: an int >= 1")
        if problems:
            raise ValueError("; ".join(problems))
        least = min_reuse_ring_blocks(self.block_m)
        if not isinstance(self.ring_blocks_limit, int) or (self.ring_blocks_limit != 0
                                                           and self.ring_blocks_limit < least):
            problems.append(f"ring_blocks_limit: got {self.ring_blocks_limit!r}; allowed: 0 (the ring covers the "
                            f"pool) or at least {least} blocks of {self.block_m} rows (a {REUSE_MAX_TILE_ROWS}-row "
                            f"token tile spans {least - 1} blocks; role1's wait on a block needs every tile over the "
                            f"block a ring's length before it readable)")
        if self.num_ranks > MAX_PEERS:
            problems.append(f"num_ranks: got {self.num_ranks}; allowed: at most {MAX_PEERS} (peer table)")
        if self.num_experts % self.num_ranks:
            problems.append(f"num_experts {self.num_experts} must be a multiple of num_ranks {self.num_ranks}")
        if self.hidden % K128 or self.intermediate % K128:
            problems.append(f"hidden {self.hidden} and intermediate {self.intermediate} must be multiples of 128")
        if self.num_shared_experts not in (0, 1):
            problems.append(f"num_shared_experts: got {self.num_shared_experts}; allowed: 0 or 1 (combine lane k)")
        if self.topk + self.num_shared_experts > 32:
            problems.append(f"topk + shared = {self.topk + self.num_shared_experts}; allowed: at most 32")
        if self.capacity * self.topk >= 1 << 31 or self.max_rows >= 1 << 31:
            problems.append("capacity * topk * num_ranks must fit an int32 row index")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def max_rows(self) -> int:
        """Most grouped rows one rank can receive: C P min(k, e) (a token meets each expert at most once)."""
        return self.capacity * self.num_ranks * min(self.topk, self.num_experts // self.num_ranks)

    @property
    def pool_blocks(self) -> int:
        """Blocks covering the whole pool of one replay (its logical blocks)."""
        return max(1, math.ceil(self.max_rows / self.block_m))

    @property
    def pool_rows(self) -> int:
        return self.pool_blocks * self.block_m

    @property
    def ring_blocks(self) -> int:
        """Ring blocks: the pool's, or ring_blocks_limit where that is smaller (then reused within a replay)."""
        if self.ring_blocks_limit:
            return min(self.ring_blocks_limit, self.pool_blocks)
        return self.pool_blocks

    @property
    def ring_reuse(self) -> bool:
        """Whether a replay may fill a ring block more than once (generations >= 1)."""
        return self.ring_blocks < self.pool_blocks

    @property
    def w1_done_words_per_expert(self) -> int:
        """W1-completion words per local expert: one per token tile of the smallest tile (8) over C P rows."""
        return max(1, math.ceil(self.capacity * self.num_ranks / 8))

    @property
    def ring_rows(self) -> int:
        return self.ring_blocks * self.block_m

    @property
    def entries_per_source(self) -> int:
        """Routing entries one source rank may write for one local expert (its tokens' slots)."""
        return self.capacity * self.topk

    @property
    def combine_lanes(self) -> int:
        return self.topk + self.num_shared_experts


def layer_regions(shape: LayerShape) -> list[Region]:
    """The region table, in allocation order (see the module docstring)."""
    s = shape
    c, h, k, e, p, r, b = s.capacity, s.hidden, s.topk, s.local_experts, s.num_ranks, s.ring_rows, s.ring_blocks
    n = s.pool_rows
    return [
        Region("x", "float8_e4m3fn", (c, h)),
        Region("x_sf", "int32", (c, h // K128)),
        Region("topk_idx", "int64", (c, k)),
        Region("topk_weights", "float32", (c, k)),
        Region("send_count", "int64", (s.num_experts,)),
        Region("recv_count", "int64", (2, p, e)),
        Region("src_index", "int32", (p, e, s.entries_per_source)),
        Region("ring_act", "float8_e4m3fn", (r, h)),
        Region("ring_scale", "float32", (r, h // K128)),
        Region("routing_weight", "float32", (n,)),
        Region("dest_row", "int32", (n,)),
        Region("ring_source", "int32", (n,)),
        Region("expert_offsets", "int32", (e + 1,)),
        Region("l2_act", "float8_e4m3fn", (r, s.intermediate)),
        Region("l2_scale", "float32", (r, s.intermediate // K128)),
        Region("combine", "bfloat16", (s.combine_lanes, c, h)),
        Region("l1_full_count", "int32", (b,)),
        Region("l1_empty_count", "int32", (b,)),
        Region("l2_empty_count", "int32", (b,)),
        Region("w1_done_mask", "int64", (e, s.w1_done_words_per_expert)),
        Region("tag1_arrive", "int32", (2,)),
        Region("combine_ready", "int32", (2,)),
        Region("control", "int32", (CONTROL_WORDS,)),
        Region("peers", "int64", (MAX_PEERS,)),
    ]


def layer_layout(shape: LayerShape) -> WorkspaceLayout:
    return WorkspaceLayout(layer_regions(shape))


def peer_offsets(peer_bases: list[int], local_base: int) -> list[int]:
    """The `peers` region's content: peer base - local base per rank (a kernel adds it to a local address)."""
    if not 1 <= len(peer_bases) <= MAX_PEERS:
        raise ValueError(f"{len(peer_bases)} peers; allowed: 1..{MAX_PEERS}")
    return [b - local_base for b in peer_bases] + [0] * (MAX_PEERS - len(peer_bases))


# ------------------------------------------------------------------------------------------------ ring arithmetic
REUSE_MAX_TILE_ROWS = 32  # the largest token tile a ring consumer reads (role2's bn 32)


def min_reuse_ring_blocks(block_m: int) -> int:
    """The smallest reused ring: one block more than a REUSE_MAX_TILE_ROWS tile can span. Role1 waits on a row of
    logical block L for the readers of block L - B; each of their tiles ends below L (and its rows can all land)
    only if B exceeds a tile's span, so the waits cannot close a cycle (docs/sm90-layer.md, ring reuse)."""
    return -(-(block_m - 1 + REUSE_MAX_TILE_ROWS) // block_m) + 1


def l1_readers(shape: LayerShape) -> int:
    """What one generation of a full ring block adds to its l1_empty_count under ring reuse: each of its BM rows
    is read by every W1 weight-row CTA (2I / 256) of its token tile, and each adds the rows it read."""
    return shape.block_m * (2 * shape.intermediate // 256)


def l1_empty_target(grouped_row: int, shape: LayerShape) -> int:
    """The l1_empty_count role1 waits for before writing `grouped_row` into a reused ring (0: no wait, the
    block's first generation)."""
    return (grouped_row // shape.block_m // shape.ring_blocks) * l1_readers(shape)


def expected_l1_empty_counts_by_rows(rows: int, shape: LayerShape) -> list[int]:
    """Every ring block's l1_empty_count once the reuse-mode W1 read `rows` grouped rows (each row once per W1
    weight-row CTA)."""
    counts = [0] * shape.ring_blocks
    for r in range(rows):
        counts[(r // shape.block_m) % shape.ring_blocks] += l1_readers(shape) // shape.block_m
    return counts


def ring_slot(logical_block: int, ring_blocks: int) -> tuple[int, int]:
    """(ring block, generation) of logical pool block `logical_block`."""
    if logical_block < 0 or ring_blocks < 1:
        raise ValueError(f"logical block {logical_block} / ring blocks {ring_blocks}: need >= 0 and >= 1")
    return logical_block % ring_blocks, logical_block // ring_blocks


def ring_row(grouped_row: int, shape: LayerShape) -> int:
    """Ring row holding grouped row `grouped_row` of this replay."""
    return grouped_row % shape.ring_rows


def expected_l1_full_count(generation: int, block_m: int) -> int:
    """The value of a ring block's l1_full_count once its `generation`-th filling is complete."""
    if generation < 0:
        raise ValueError(f"generation {generation} < 0")
    return block_m * (generation + 1)


def l1_full_counts_after_dispatch(rows: int, shape: LayerShape) -> list[int]:
    """Every ring block's l1_full_count after role1 pulled `rows` grouped rows: one per landed row, plus the
    padding of the last partial block (so a full block always reads BM (generation + 1))."""
    if not 0 <= rows <= shape.pool_rows:
        raise ValueError(f"rows {rows} outside 0..{shape.pool_rows}")
    counts = [0] * shape.ring_blocks
    for r in range(rows):
        counts[(r // shape.block_m) % shape.ring_blocks] += 1
    if rows % shape.block_m:
        counts[(rows // shape.block_m) % shape.ring_blocks] += shape.block_m - rows % shape.block_m
    return counts


def blocks_of_tile(first_row: int, rows: int, block_m: int) -> range:
    """Logical blocks a consumer tile of grouped rows [first_row, first_row + rows) must acquire."""
    if rows < 1:
        return range(0)
    return range(first_row // block_m, (first_row + rows - 1) // block_m + 1)


def packed_send_count(counts_per_cta: list[int]) -> int:
    """send_count of one expert after every dispatch CTA added (1 << 32) | its count (also 0)."""
    return sum(PACKED_CONTRIBUTOR | c for c in counts_per_cta)


def unpack_count(packed: int) -> tuple[int, int]:
    """(contributors, tokens) of a packed count."""
    return packed >> 32, packed & 0xFFFFFFFF


def expected_arrivals(dispatch_ctas: int) -> int:
    """Contributors every (source rank, local expert) receive count must show: the source's dispatch grid."""
    return dispatch_ctas


def expected_arrivals_per_expert(dispatch_ctas: int, num_ranks: int) -> int:
    """Contributors summed over the source ranks of one local expert: dispatch_sms P (Section 4.6)."""
    return dispatch_ctas * num_ranks


def grouped_layout(topk_idx_per_rank: list, shape: LayerShape, owner: int):
    """Host twin of role1's grouped order on rank `owner`, from every rank's topk_idx (lists or tensors [T_r, k]).

    Returns (expert_offsets [e + 1], segments) where segments[(local expert, source rank)] = (first grouped row,
    sorted list of token * k + slot). Within a segment the kernel's order is not fixed (atomics); the set is.
    """
    e, k = shape.local_experts, shape.topk
    lists = {}
    for src, idx in enumerate(topk_idx_per_rank):
        rows = idx.tolist() if hasattr(idx, "tolist") else idx
        for t, row in enumerate(rows):
            for j, g in enumerate(row):
                if g >= 0 and g // e == owner:
                    lists.setdefault((g % e, src), []).append(t * k + j)
    offsets, segments, row = [], {}, 0
    for le in range(e):
        offsets.append(row)
        for src in range(len(topk_idx_per_rank)):
            entries = sorted(lists.get((le, src), []))
            segments[(le, src)] = (row, entries)
            row += len(entries)
    offsets.append(row)
    return offsets, segments


def dest_row(token: int, slot: int, shape: LayerShape) -> int:
    """Row of the source rank's combine buffer [k + 1, C, H] a grouped row's W2 partial goes to."""
    return slot * shape.capacity + token


def ring_source(src_rank: int, token: int, slot: int, shape: LayerShape) -> int:
    """The ring_source word of a grouped row: src_rank C k + token k + slot."""
    return (src_rank * shape.capacity + token) * shape.topk + slot


# ------------------------------------------------------------------------------------------------ host setup
STATE_REGIONS = ("send_count", "recv_count", "l1_full_count", "l1_empty_count", "l2_empty_count", "w1_done_mask",
                 "tag1_arrive", "combine_ready", "control")


class LocalWorkspace:
    """The layer's regions as views of one plain tensor (single process, tests); a
    `gc_moe.runtime.workspace.SymmetricWorkspace` of the same layout serves P ranks."""

    def __init__(self, layout: WorkspaceLayout, device="cpu"):
        import torch

        self.layout = layout
        self.buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        self.base = self.buffer.data_ptr()
        self.peer_bases = [self.base]
        self.rank, self.world_size = 0, 1
        self.views = {}
        for r in layout.regions:
            start = layout.offsets[r.name]
            self.views[r.name] = self.buffer[start:start + r.nbytes].view(getattr(torch, r.dtype)).view(r.shape)

    def __getattr__(self, name: str):
        views = self.__dict__.get("views", {})
        if name in views:
            return views[name]
        raise AttributeError(name)


def initialize_state(ws) -> None:
    """Zero every signal and counter (once, before the first replay; replays keep them consistent themselves)
    and write the peer table from the workspace's peer bases."""
    import torch

    for name in STATE_REGIONS:
        getattr(ws, name).zero_()
    offsets = peer_offsets([int(b) for b in ws.peer_bases], int(ws.base))
    ws.peers.copy_(torch.tensor(offsets, dtype=torch.int64))
