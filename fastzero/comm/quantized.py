"""ZeRO++'s quantized collectives: the param all-gather in int8 (qwZ) and
the gradient reduce-scatter as an all-to-all of int4/int8 codes (qgZ), flat
or hierarchical (inside each node first, then across nodes).

Values travel as block-wise symmetric codes with one fp32 scale per block
(:mod:`fastzero.ops.quant`). Each rank-sized chunk is quantized on its own, so
blocks never straddle two ranks' chunks (a chunk that is not a whole number
of blocks ends in a partial block), and its codes and scales travel packed
in one byte buffer, ``[codes | scales]``: one collective per chunk set, and
the comm record's bytes are what really moves (codes plus scales).

* :class:`QuantizedGather`: rank r's chunk quantized, every rank's packed
  chunk all-gathered, each dequantized into its place of `out`, the rank's
  own included, so every rank holds the same (dequantized) values.
* :class:`QuantizedReduceScatter`: each destination's chunk of the input
  quantized (stochastic rounding optional: each sender's seed differs, so
  the ranks' rounding errors do not line up), an all-to-all delivers every
  chunk to its owner, which sums the ranks' dequantized values in fp32 and
  writes its chunk once (:func:`fastzero.ops.quant.dequantize_sum`). With a
  :class:`Hierarchy` (more than one node), an all-to-all inside each node
  first delivers each rank the chunks of the owners with its local index,
  summed over the node; those sums are quantized again and an all-to-all
  across nodes, among the ranks with the same local index, brings each owner
  its chunk: 1/ranks-per-node of the bytes cross nodes.

Both are handles: launched at construction, finished by ``wait(site)``
(which dequantizes), with the collective's :class:`CommEvent` as ``event``.
"""

from __future__ import annotations

import socket
import warnings
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastzero.comm.collectives import Comm, Handle, new_groups
from fastzero.comm.env import dist_env
from fastzero.ops import quant

_MASK64 = (1 << 64) - 1


def mix_seed(*keys: int) -> int:
    """A 32-bit seed from integer keys (splitmix64 over each in turn): the
    same keys give the same seed on every rank and run."""
    h = 0x9E3779B97F4A7C15
    for k in keys:
        h = (h ^ (int(k) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h & 0xFFFFFFFF


@dataclass(frozen=True)
class QuantFormat:
    """Block-wise symmetric codes: `bits` 8 (int8) or 4 (int4, two a byte),
    one fp32 scale per `block` values; `stochastic` rounding (gradients)
    or round to nearest even."""

    bits: int = 8
    block: int = 256
    stochastic: bool = False

    def __post_init__(self) -> None:
        quant._check_format(self.bits, self.block, "QuantFormat")

    def code_bytes(self, n: int) -> int:
        return quant.code_numel(n, self.bits)

    def scale_offset(self, n: int) -> int:
        """Where the scales start in a packed chunk of `n` values (4-aligned)."""
        return -(-self.code_bytes(n) // 4) * 4

    def packed_bytes(self, n: int) -> int:
        """Bytes of one packed chunk of `n` values: codes, then its scales."""
        return self.scale_offset(n) + 4 * -(-n // self.block)

    def pack(self, x: Tensor, out: Tensor, seed: int = 0) -> None:
        """`x` (n values) quantized into `out` (uint8, :meth:`packed_bytes` of n)."""
        codes, scales = self.unpack(out, x.numel())
        quant.quantize_blockwise(x, self.bits, self.block, stochastic=self.stochastic, seed=seed, out=(codes, scales))

    def unpack(self, packed: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """The (codes, scales) views of a packed chunk of `n` values."""
        codes = packed[: self.code_bytes(n)]
        codes = codes.view(torch.int8) if self.bits == 8 else codes
        lo = self.scale_offset(n)
        return codes, packed[lo : lo + 4 * -(-n // self.block)].view(torch.float32)

    def dequantize(self, packed: Tensor, out: Tensor) -> None:
        codes, scales = self.unpack(packed, out.numel())
        quant.dequantize_blockwise(codes, scales, out=out, block=self.block)

    def dequantize_sum(self, rows: Tensor, out: Tensor) -> None:
        """out = the sum of the packed chunks in `rows` ([ranks, packed_bytes])."""
        n = out.numel()
        lo, nb = self.scale_offset(n), -(-n // self.block)
        codes = rows[:, : self.code_bytes(n)].contiguous()
        codes = codes.view(torch.int8) if self.bits == 8 else codes
        scales = rows[:, lo : lo + 4 * nb].contiguous().view(torch.float32)
        quant.dequantize_sum(codes, scales, out, block=self.block)


def _packed(fmt: QuantFormat, chunks: list[Tensor], seeds: list[int], device) -> Tensor:
    """The chunks (equal sizes) quantized into one uint8 buffer, back to back."""
    seg = fmt.packed_bytes(chunks[0].numel())
    out = torch.empty(len(chunks) * seg, dtype=torch.uint8, device=device)
    for k, (x, seed) in enumerate(zip(chunks, seeds)):
        fmt.pack(x, out[k * seg : (k + 1) * seg], seed)
    return out


class QuantizedGather:
    """``out`` (world x n) becomes every rank's `inp` (n values, this rank's
    chunk; it may be a view of `out`), through int8/int4 codes: see the
    module docstring. Wait with :meth:`wait`."""

    def __init__(self, comm: Comm, out: Tensor, inp: Tensor, fmt: QuantFormat, tag: str = "param") -> None:
        self.comm, self.out, self.fmt, self.n = comm, out, fmt, inp.numel()
        self._send = _packed(fmt, [inp.reshape(-1)], [0], out.device)
        self._recv = torch.empty(comm.world_size * self._send.numel(), dtype=torch.uint8, device=out.device)
        self.handle: Handle | None = comm.all_gather(self._recv, self._send, tag)
        self.event = self.handle.event

    def wait(self, site: str = "") -> None:
        if self.handle is None:
            return
        self.handle.wait(site)
        self.handle = None
        rows, n, flat = self._recv.view(self.comm.world_size, -1), self.n, self.out.view(-1)
        for r in range(self.comm.world_size):
            self.fmt.dequantize(rows[r], flat[r * n : (r + 1) * n])
        self._send = self._recv = None


@dataclass
class Hierarchy:
    """A data-parallel group cut into nodes of equal size, node-major (data
    rank d = node * local_size + local index): `intra` is this rank's node,
    `inter` the ranks with this rank's local index, one per node."""

    intra: Comm
    inter: Comm
    nodes: int
    local_size: int


def node_key() -> tuple[str, int]:
    """What tells this rank's node from others': its host and ``RANK -
    LOCAL_RANK`` (launchers give a node consecutive ranks from local rank
    0), so several simulated nodes on one host stay apart."""
    env = dist_env()
    return socket.gethostname(), env.rank - env.local_rank


def node_ranks(comm: Comm) -> list[list[int]]:
    """The global ranks of `comm`'s group, per node (in order of their first
    rank). One small all-gather; every rank of the group calls it."""
    keys = comm.all_gather_objects(node_key())
    nodes: dict[tuple, list[int]] = {}
    for rank, key in zip(comm.ranks, keys):
        nodes.setdefault(key, []).append(rank)
    return list(nodes.values())


def hierarchy(comm: Comm, nodes: list[list[int]]) -> Hierarchy | None:
    """The :class:`Hierarchy` of `comm` over `nodes` (from :func:`node_ranks`),
    or None for one node, one rank per node, or nodes that cannot form one
    (unequal sizes, or not node-major in the group's order: a warning says
    so and the reduction stays flat). Creates process groups: every rank of
    the world calls it (with its own data group)."""
    if not comm.distributed:
        return None
    sizes = {len(n) for n in nodes}
    flat_order = [r for n in nodes for r in n] == list(comm.ranks)
    usable = len(nodes) > 1 and len(sizes) == 1 and next(iter(sizes)) > 1 and flat_order
    if len(nodes) > 1 and not usable and comm.rank == 0:
        why = "nodes of unequal size" if len(sizes) > 1 else "one rank per node" if sizes == {1} else "not node-major"
        warnings.warn(
            f"zero_quantized_gradients: the data-parallel ranks {list(comm.ranks)} span {len(nodes)} nodes "
            f"({why}), so the quantized reduction is flat, not hierarchical",
            stacklevel=3,
        )
    me = comm.ranks[comm.rank]
    mine = next(n for n in nodes if me in n)
    local = mine.index(me)
    rail = [n[local] for n in nodes] if usable else []
    wanted = [mine, rail] if usable else []
    groups = new_groups(wanted)  # collective: ranks that need no hierarchy still take part
    if not usable:
        return None
    return Hierarchy(Comm(groups[0]), Comm(groups[1]), len(nodes), len(mine))


class QuantizedReduceScatter:
    """``out`` (n values) becomes this rank's chunk of the sum over ranks of
    `inp` (world x n), through int4/int8 codes: see the module docstring.
    `seed` keys the stochastic rounding (mixed with sender and receiver).
    Wait with :meth:`wait`."""

    def __init__(
        self,
        comm: Comm,
        out: Tensor,
        inp: Tensor,
        fmt: QuantFormat,
        tag: str = "grad",
        seed: int = 0,
        hierarchy: Hierarchy | None = None,
        queue: deque | None = None,
    ) -> None:
        """`queue`: hierarchical reductions whose cross-node phase is still
        to launch, shared by every reduction over the same groups, in launch
        order: each rank launches those phases in that order (a collective
        order that timing could otherwise change across ranks)."""
        self.comm, self.out, self.fmt, self.tag, self.seed, self.h = comm, out, fmt, tag, seed, hierarchy
        n, world = out.numel(), comm.world_size
        chunks = inp.reshape(world, n)
        if hierarchy is None:  # chunk r to rank r
            order, peers = list(range(world)), comm
        else:  # to each local peer l: the chunks of the owners with local index l, node by node
            L, N = hierarchy.local_size, hierarchy.nodes
            order, peers = [node * L + local for local in range(L) for node in range(N)], hierarchy.intra
        seeds = [mix_seed(seed, comm.rank, dest) for dest in order]
        self._send = _packed(fmt, [chunks[d] for d in order], seeds, out.device)
        self._recv = torch.empty_like(self._send)
        self.handle: Handle | None = peers.all_to_all(self._recv, self._send, tag)
        self.event = self.handle.event
        self._inter: Handle | None = None  # hierarchical: the cross-node all-to-all, once launched
        self._queue = deque() if queue is None else queue
        if hierarchy is not None:
            self._queue.append(self)

    def ready(self) -> bool:
        """Whether the node phase has landed (its event says so; nothing blocks)."""
        return self.event.done is not None

    def _launch_inter(self, site: str) -> None:
        """Quantizes the node's sums again and launches the cross-node
        all-to-all; the reductions queued before this one first."""
        while self._queue and self._queue[0] is not self:
            self._queue[0]._launch_inter(site)
        self._queue.popleft()
        h, n = self.h, self.out.numel()
        self.handle.wait(site)
        # from each local peer, N chunks (one per node's owner with this local index): the node's sums
        rows = self._recv.view(h.local_size, h.nodes, -1)
        sums = torch.empty(h.nodes, n, dtype=torch.float32, device=self.out.device)
        for node in range(h.nodes):
            self.fmt.dequantize_sum(rows[:, node], sums[node])
        seeds = [mix_seed(self.seed, self.comm.rank, node, 1 << 40) for node in range(h.nodes)]
        self._send = _packed(self.fmt, list(sums), seeds, self.out.device)
        self._recv = torch.empty_like(self._send)
        self._inter = h.inter.all_to_all(self._recv, self._send, self.tag)

    def wait(self, site: str = "") -> None:
        if self.handle is None:
            return
        if self.h is None:
            self.handle.wait(site)
            self.fmt.dequantize_sum(self._recv.view(self.comm.world_size, -1), self.out)
        else:
            if self._inter is None:
                self._launch_inter(site)
            self._inter.wait(site)
            self.fmt.dequantize_sum(self._recv.view(self.h.nodes, -1), self.out)
        self.handle = self._inter = None
        self._send = self._recv = None


@dataclass
class GradQuant:
    """qgZ for one engine: the format and, with several nodes, the
    hierarchy. `round` (set by the engine before each backward: its micro
    step) keys the stochastic rounding with each reducer's key and bucket, so
    a resumed run rounds as the uninterrupted one did."""

    fmt: QuantFormat
    hierarchy: Hierarchy | None = None
    round: int = 0
    pending: deque = field(default_factory=deque)  # hierarchical: cross-node phases to launch, in order

    def reduce_scatter(self, comm: Comm, out: Tensor, inp: Tensor, tag: str, key: int) -> QuantizedReduceScatter:
        seed = mix_seed(self.round, key)
        return QuantizedReduceScatter(comm, out, inp, self.fmt, tag, seed, self.hierarchy, self.pending)

    def advance(self) -> None:
        """Hierarchical: the reductions whose node phase has landed go on to
        their cross-node phase, in launch order, up to the first that has
        not landed (the gradient reducer calls it as backward goes on), so
        that phase overlaps what runs next."""
        while self.pending and self.pending[0].ready():
            self.pending[0]._launch_inter("")
