"""Block-sparse attention layouts: hand-checked layouts from DeepSpeed's documented definitions of each pattern,
properties over a grid of parameters, every validation error, and dense_mask against the layout."""

import inspect
import itertools
import random

import pytest
import torch

from fastzero.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
    dense_mask,
    layout_density,
)

ATTENTIONS = ["bidirectional", "unidirectional"]


def grid(*rows: str) -> torch.Tensor:
    """A one-head layout from rows of 0/1 characters (spaces ignored)."""
    return torch.tensor([[int(c) for c in r.replace(" ", "")] for r in rows], dtype=torch.int64)


def band(num_blocks: int, below: int, above: int) -> torch.Tensor:
    i = torch.arange(num_blocks)
    d = i[:, None] - i[None, :]
    return ((d <= below) & (-d <= above)).to(torch.int64)


def check_layout(layout, num_heads, num_blocks):
    assert layout.dtype == torch.int64
    assert layout.shape == (num_heads, num_blocks, num_blocks)
    assert set(layout.unique().tolist()) <= {0, 1}


def all_configs():
    """One of each config with small windows, in both directions where it has them, for the shared properties."""
    for att in ATTENTIONS:
        yield FixedSparsityConfig(3, 2, num_local_blocks=4, num_global_blocks=2, attention=att)
        yield VariableSparsityConfig(3, 2, True, 2, [1, 3], [0, 5], [2, 6], attention=att, seed=0)
        yield BigBirdSparsityConfig(3, 2, True, 2, 3, 1, attention=att, seed=0)
        yield BSLongformerSparsityConfig(3, 2, num_sliding_window_blocks=5, global_block_indices=[3], attention=att)
        yield LocalSlidingWindowSparsityConfig(3, 2, 3, attention=att)
    yield DenseSparsityConfig(3, 2)


# --- defaults and the base class ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, defaults",
    [
        (SparsityConfig, dict(block=16, different_layout_per_head=False)),
        (DenseSparsityConfig, dict(block=16, different_layout_per_head=False)),
        (
            FixedSparsityConfig,
            dict(
                block=16,
                different_layout_per_head=False,
                num_local_blocks=4,
                num_global_blocks=1,
                attention="bidirectional",
                horizontal_global_attention=False,
                num_different_global_patterns=1,
            ),
        ),
        (
            VariableSparsityConfig,
            dict(
                block=16,
                different_layout_per_head=False,
                num_random_blocks=0,
                local_window_blocks=[4],
                global_block_indices=[0],
                global_block_end_indices=None,
                attention="bidirectional",
                horizontal_global_attention=False,
            ),
        ),
        (
            BigBirdSparsityConfig,
            dict(
                block=16,
                different_layout_per_head=False,
                num_random_blocks=1,
                num_sliding_window_blocks=3,
                num_global_blocks=1,
                attention="bidirectional",
            ),
        ),
        (
            BSLongformerSparsityConfig,
            dict(
                block=16,
                different_layout_per_head=False,
                num_sliding_window_blocks=3,
                global_block_indices=[0],
                global_block_end_indices=None,
                attention="bidirectional",
            ),
        ),
        (LocalSlidingWindowSparsityConfig, dict(block=16, num_sliding_window_blocks=3, attention="unidirectional")),
    ],
)
def test_defaults_and_positional_order_match_deepspeed(cls, defaults):
    params = list(inspect.signature(cls).parameters.values())
    assert params[0].name == "num_heads"
    positional = [p.name for p in params[1:] if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == list(defaults)  # DeepSpeed's order, so positional calls carry over
    config = cls(2)
    for name, value in defaults.items():
        assert getattr(config, name) == value, name
    assert config.num_layout_heads == 1


def test_setup_layout_and_propagation():
    config = SparsityConfig(3, block=4)
    layout = config.setup_layout(20)
    check_layout(layout, 3, 5)
    assert not layout.any()
    layout[0, 1, 2] = 1
    assert config.check_and_propagate_first_head_layout(layout)[:, 1, 2].tolist() == [1, 1, 1]
    own = SparsityConfig(3, block=4, different_layout_per_head=True)
    assert own.num_layout_heads == 3
    layout = own.setup_layout(8)
    layout[0, 0, 0] = 1
    assert own.check_and_propagate_first_head_layout(layout)[:, 0, 0].tolist() == [1, 0, 0]
    with pytest.raises(NotImplementedError, match="SparsityConfig does not define a layout"):
        config.make_layout(16)


def test_default_block_is_16():
    layout = FixedSparsityConfig(2).make_layout(128)
    check_layout(layout, 2, 8)
    assert torch.equal(layout, FixedSparsityConfig(2, block=1).make_layout(8))


def test_dense():
    layout = DenseSparsityConfig(4, block=2, different_layout_per_head=True).make_layout(10)
    check_layout(layout, 4, 5)
    assert layout.all() and layout_density(layout) == 1.0


# --- Fixed --------------------------------------------------------------------------------------------------------

# 8 blocks, windows of 4: local squares [0, 4) and [4, 8); head 0's global block is the last of each window (3, 7).
FIXED_BI = grid(
    "1111 0001",
    "1111 0001",
    "1111 0001",
    "1111 0001",
    "0001 1111",
    "0001 1111",
    "0001 1111",
    "0001 1111",
)
FIXED_UNI = grid(
    "1000 0000",
    "1100 0000",
    "1110 0000",
    "1111 0000",
    "0001 1000",
    "0001 1100",
    "0001 1110",
    "0001 1111",
)


def test_fixed_hand_checked():
    bi = FixedSparsityConfig(2, block=1).make_layout(8)
    check_layout(bi, 2, 8)
    assert torch.equal(bi[0], FIXED_BI) and torch.equal(bi[1], FIXED_BI)
    assert torch.equal(FixedSparsityConfig(1, block=1, attention="unidirectional").make_layout(8)[0], FIXED_UNI)
    horizontal = FIXED_BI.clone()
    horizontal[[3, 7]] = 1
    got = FixedSparsityConfig(1, block=1, horizontal_global_attention=True).make_layout(8)[0]
    assert torch.equal(got, horizontal)


def test_fixed_short_last_window():
    # 6 blocks: windows [0, 4) and a short [4, 6); the short window's global block (offset 3) is moved to block 5
    expected = grid(
        "1111 01",
        "1111 01",
        "1111 01",
        "1111 01",
        "0001 11",
        "0001 11",
    )
    assert torch.equal(FixedSparsityConfig(1, block=1).make_layout(6)[0], expected)
    # 9 blocks, windows of 4 with 2 global blocks: head 0 takes blocks 2-3, 6-7, and 7-8 for the 1-block window
    layout = FixedSparsityConfig(1, block=1, num_global_blocks=2).make_layout(9)[0]
    assert torch.nonzero(layout.all(dim=0)).flatten().tolist() == [2, 3, 6, 7, 8]


def test_fixed_global_pattern_rotates_across_heads():
    config = FixedSparsityConfig(
        6, block=1, different_layout_per_head=True, num_local_blocks=4, num_different_global_patterns=4
    )
    layout = config.make_layout(8)
    for h in range(6):
        global_cols = torch.nonzero(layout[h].all(dim=0)).flatten().tolist()
        first = 3 - h % 4  # head 0: the last block of each window, head 1 the one before, ...
        assert global_cols == [first, first + 4], h
    # with two global blocks per window there are two groups: the last two blocks, then the first two
    config = FixedSparsityConfig(3, 1, True, num_local_blocks=4, num_global_blocks=2, num_different_global_patterns=2)
    layout = config.make_layout(8)
    cols = [torch.nonzero(layout[h].all(dim=0)).flatten().tolist() for h in range(3)]
    assert cols == [[2, 3, 6, 7], [0, 1, 4, 5], [2, 3, 6, 7]]


def test_fixed_different_layout_per_head_without_patterns_gives_identical_heads():
    layout = FixedSparsityConfig(3, block=1, different_layout_per_head=True).make_layout(8)
    assert all(torch.equal(layout[h], FIXED_BI) for h in range(3))


def test_fixed_causal_with_wide_global_groups_stays_below_the_diagonal():
    # DeepSpeed keeps blocks (2, 3) and (6, 7) here: the global group's full width from its first row down.
    expected = grid(
        "1000 0000",
        "1100 0000",
        "1110 0000",
        "1111 0000",
        "0011 1000",
        "0011 1100",
        "0011 1110",
        "0011 1111",
    )
    got = FixedSparsityConfig(1, block=1, num_global_blocks=2, attention="unidirectional").make_layout(8)[0]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("num_local_blocks, num_global_blocks", [(1, 1), (2, 1), (3, 1), (4, 2), (6, 3), (6, 2)])
def test_fixed_properties(attention, num_local_blocks, num_global_blocks):
    n, g = num_local_blocks, num_global_blocks
    for num_blocks, horizontal in itertools.product([1, 2, 5, 7, 12, 13], [False, True]):
        if horizontal and attention == "unidirectional":
            continue
        config = FixedSparsityConfig(2, 1, False, n, g, attention, horizontal)
        layout = config.make_layout(num_blocks)[0]
        check_layout(layout[None], 1, num_blocks)
        ones = torch.ones(n, n, dtype=torch.int64)
        window = ones.tril() if attention == "unidirectional" else ones
        for s in range(0, num_blocks, n):  # every local window, whole (clipped at the end)
            w = min(n, num_blocks - s)
            assert torch.equal(layout[s : s + w, s : s + w], window[:w, :w]), (num_blocks, s)
        # the global columns: the last g blocks of each whole window, and of the short last window (moved to fit)
        starts = [s + n - g for s in range(0, num_blocks - num_blocks % n, n)]
        if num_blocks % n:
            starts.append(max(0, min(num_blocks - num_blocks % n + n - g, num_blocks - g)))
        cols = sorted({c for s in starts for c in range(s, min(s + g, num_blocks))})
        for c in cols:
            assert layout[c:, c].all(), (num_blocks, c)
            if attention == "bidirectional":
                assert layout[:, c].all()
            if horizontal:
                assert layout[c, :].all()
        # nothing else: outside the windows, only the global columns (and rows) are kept
        rest = layout.clone()
        for s in range(0, num_blocks, n):
            rest[s : s + n, s : s + n] = 0
        rest[:, cols] = 0
        if horizontal:
            rest[cols, :] = 0
        assert not rest.any(), num_blocks
        if attention == "unidirectional":
            assert torch.equal(layout, layout.tril())


# --- Variable -----------------------------------------------------------------------------------------------------

# 8 blocks, windows of 1, 2, 3 then 3 again (clipped to 2): [0], [1, 3), [3, 6), [6, 8); block 0 global.
VARIABLE_BI = grid(
    "1 00 000 00",
    "1 11 000 00",
    "1 11 000 00",
    "1 00 111 00",
    "1 00 111 00",
    "1 00 111 00",
    "1 00 000 11",
    "1 00 000 11",
)


def test_variable_hand_checked():
    config = VariableSparsityConfig(2, 1, local_window_blocks=[1, 2, 3], global_block_indices=[0])
    layout = config.make_layout(8)
    check_layout(layout, 2, 8)
    assert torch.equal(layout[0], VARIABLE_BI) and torch.equal(layout[1], VARIABLE_BI)
    causal = VariableSparsityConfig(1, 1, local_window_blocks=[1, 2, 3], attention="unidirectional")
    assert torch.equal(causal.make_layout(8)[0], VARIABLE_BI.tril())
    horizontal = VariableSparsityConfig(1, 1, local_window_blocks=[1, 2, 3], horizontal_global_attention=True)
    expected = VARIABLE_BI.clone()
    expected[0] = 1
    assert torch.equal(horizontal.make_layout(8)[0], expected)


def test_variable_default_is_fixed_windows_of_4_with_block_0_global():
    expected = grid(
        "1111 0000",
        "1111 0000",
        "1111 0000",
        "1111 0000",
        "1000 1111",
        "1000 1111",
        "1000 1111",
        "1000 1111",
    )
    assert torch.equal(VariableSparsityConfig(1, 1).make_layout(8)[0], expected)


def test_variable_global_spans_and_out_of_range_indices():
    # spans [2, 4) and [6, 20): the second is clipped to the sequence; index 9 is past 8 blocks and skipped
    config = VariableSparsityConfig(
        1, 1, local_window_blocks=[1], global_block_indices=[2, 6], global_block_end_indices=[4, 20]
    )
    layout = config.make_layout(8)[0]
    expected = torch.eye(8, dtype=torch.int64)
    expected[:, [2, 3, 6, 7]] = 1
    assert torch.equal(layout, expected)
    skipped = VariableSparsityConfig(1, 1, local_window_blocks=[1], global_block_indices=[1, 9]).make_layout(8)[0]
    expected = torch.eye(8, dtype=torch.int64)
    expected[:, 1] = 1
    assert torch.equal(skipped, expected)
    causal = VariableSparsityConfig(
        1,
        1,
        local_window_blocks=[1],
        global_block_indices=[2],
        global_block_end_indices=[4],
        attention="unidirectional",
    )
    got = causal.make_layout(8)[0]
    assert torch.equal(got, got.tril()) and got[2:, 2].all() and got[3:, 3].all() and got[2, 3] == 0


def expected_random(seed, num_blocks, k, causal, heads=1):
    """DeepSpeed's draw order: per head, per row, one sample of k columns (causal: from the columns up to the row)."""
    rng = random.Random(seed)
    out = torch.zeros(heads, num_blocks, num_blocks, dtype=torch.int64)
    for h, row in itertools.product(range(heads), range(num_blocks)):
        population = row + 1 if causal else num_blocks
        out[h, row, rng.sample(range(population), min(k, population))] = 1
    return out


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_variable_random_blocks_are_seeded_and_in_range(attention):
    causal = attention == "unidirectional"
    state = random.getstate()

    def make(seed, **kw):
        return VariableSparsityConfig(3, 1, False, 3, [1], [], attention=attention, seed=seed, **kw)

    layout = make(7).make_layout(10)
    assert random.getstate() == state  # the global RNG is neither used nor disturbed
    expected = expected_random(7, 10, 3, causal) | torch.eye(10, dtype=torch.int64)
    assert torch.equal(layout, expected.expand(3, -1, -1))
    assert torch.equal(make(7).make_layout(10), layout)
    assert not torch.equal(make(8).make_layout(10), layout)
    # one config draws afresh on each call, like DeepSpeed's global RNG; the same seed gives the same sequence
    a, b = make(7), make(7)
    a.make_layout(10)
    b.make_layout(10)
    assert torch.equal(a.make_layout(10), b.make_layout(10))
    # a shared generator
    gen = random.Random(7)
    assert torch.equal(make(None, generator=gen).make_layout(10), layout)
    # beside the diagonal, every row keeps k random blocks (k - 1 if one fell on the diagonal), or all it may have
    # when a causal row is shorter than k
    for row, kept in enumerate(layout[0].sum(dim=1).tolist()):
        population = row + 1 if causal else 10
        assert min(3, population) <= kept <= min(4, population), row


def test_variable_different_layout_per_head_draws_per_head():
    config = VariableSparsityConfig(
        4, 1, True, num_random_blocks=2, local_window_blocks=[1], global_block_indices=[], seed=3
    )
    layout = config.make_layout(12)
    expected = expected_random(3, 12, 2, causal=False, heads=4) | torch.eye(12, dtype=torch.int64)
    assert torch.equal(layout, expected)
    assert len({tuple(layout[h].flatten().tolist()) for h in range(4)}) > 1


# --- BigBird ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_bigbird_hand_checked(attention):
    # no random blocks: a band of 3 and block 0 as global row and column
    expected = grid(
        "11111111",
        "11100000",
        "11110000",
        "10111000",
        "10011100",
        "10001110",
        "10000111",
        "10000011",
    )
    if attention == "unidirectional":
        expected = expected.tril()
    layout = BigBirdSparsityConfig(2, 1, num_random_blocks=0, attention=attention).make_layout(8)
    check_layout(layout, 2, 8)
    assert torch.equal(layout[0], expected) and torch.equal(layout[1], expected)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("window, width", [(1, 1), (2, 3), (3, 3), (4, 5), (5, 5)])
@pytest.mark.parametrize("num_global_blocks", [0, 1, 3])
@pytest.mark.parametrize("num_random_blocks", [0, 1, 3])
def test_bigbird_properties(attention, window, width, num_global_blocks, num_random_blocks):
    causal = attention == "unidirectional"
    config = BigBirdSparsityConfig(2, 1, True, num_random_blocks, window, num_global_blocks, attention, seed=4)
    layout = config.make_layout(9)
    check_layout(layout, 2, 9)
    w = width // 2  # an even window is one block wider, as in DeepSpeed
    expected = band(9, w, 0 if causal else w).expand(2, -1, -1).clone()
    expected[:, :num_global_blocks, :] = 1
    expected[:, :, :num_global_blocks] = 1
    expected |= expected_random(4, 9, num_random_blocks, causal, heads=2)
    if causal:
        expected = expected.tril()
    assert torch.equal(layout, expected)


def test_bigbird_seed_and_heads():
    make = lambda seed, per_head: BigBirdSparsityConfig(4, 1, per_head, num_random_blocks=2, seed=seed)
    shared = make(0, False).make_layout(16)
    assert all(torch.equal(shared[h], shared[0]) for h in range(4))
    assert torch.equal(make(0, False).make_layout(16), shared)
    per_head = make(0, True).make_layout(16)
    assert torch.equal(per_head[0], shared[0])  # head 0 makes the same draws either way
    assert len({tuple(per_head[h].flatten().tolist()) for h in range(4)}) > 1


def test_bigbird_causal_rows_shorter_than_num_random_blocks():
    # DeepSpeed's random.sample fails on row 0 here; every row takes what it may have instead
    config = BigBirdSparsityConfig(1, 1, num_random_blocks=4, num_global_blocks=0, attention="unidirectional", seed=0)
    got = config.make_layout(6)[0]
    assert torch.equal(got, got.tril())
    assert got.sum(dim=1)[:4].tolist() == [1, 2, 3, 4]  # rows 0-3 have at most row + 1 blocks: all of them


# --- BSLongformer -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_longformer_hand_checked(attention):
    # band of 3, global span [2, 4) as rows and columns
    expected = grid(
        "11110000",
        "11110000",
        "11111111",
        "11111111",
        "00111100",
        "00111110",
        "00110111",
        "00110011",
    )
    if attention == "unidirectional":
        expected = expected.tril()
    config = BSLongformerSparsityConfig(2, 1, True, 3, [2], [4], attention=attention)
    layout = config.make_layout(8)
    check_layout(layout, 2, 8)
    assert torch.equal(layout[0], expected) and torch.equal(layout[1], expected)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("window, width", [(1, 1), (3, 3), (4, 5), (7, 7)])
@pytest.mark.parametrize("spans", [([0], None), ([0, 4, 20], None), ([1, 5], [3, 50]), ([], None)])
def test_longformer_properties(attention, window, width, spans):
    causal = attention == "unidirectional"
    layout = BSLongformerSparsityConfig(1, 1, False, window, *spans, attention=attention).make_layout(10)[0]
    w = width // 2
    expected = band(10, w, 0 if causal else w)
    starts, ends = spans
    for s, e in zip(starts, ends or [s + 1 for s in starts]):
        expected[s:e, :] = 1
        expected[:, s:e] = 1
    if causal:
        expected = expected.tril()
    assert torch.equal(layout, expected)


# --- LocalSlidingWindow -------------------------------------------------------------------------------------------


def test_local_sliding_window():
    causal = LocalSlidingWindowSparsityConfig(2, 1).make_layout(6)  # default: causal, window 3 -> 2 blocks a row
    check_layout(causal, 2, 6)
    assert torch.equal(causal[0], band(6, 1, 0)) and torch.equal(causal[1], band(6, 1, 0))
    assert causal[0].sum(dim=1).tolist() == [1, 2, 2, 2, 2, 2]
    bi = LocalSlidingWindowSparsityConfig(1, 1, 5, attention="bidirectional").make_layout(6)[0]
    assert torch.equal(bi, band(6, 2, 2))
    assert torch.equal(LocalSlidingWindowSparsityConfig(1, 1, 4).make_layout(6)[0], band(6, 2, 0))


# --- shared properties --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(all_configs()), ids=lambda c: f"{type(c).__name__}-{c.attention}")
def test_every_config_shape_diagonal_and_causality(config):
    for seq_len in [16, 18, 24]:
        layout = config.make_layout(seq_len)
        num_blocks = seq_len // config.block
        check_layout(layout, config.num_heads, num_blocks)
        # every query block attends at least to itself: no row of a layout is empty
        assert layout.diagonal(dim1=1, dim2=2).all()
        if config.attention == "unidirectional":
            assert not layout.triu(1).any()
        if not config.different_layout_per_head:
            assert all(torch.equal(layout[h], layout[0]) for h in range(config.num_heads))
        assert 0 < layout_density(layout) <= 1


# --- validation ---------------------------------------------------------------------------------------------------

CONSTRUCTION_ERRORS = [
    (lambda: SparsityConfig(0), ValueError, r"num_heads must be an integer >= 1, got 0"),
    (lambda: DenseSparsityConfig(2, block=0), ValueError, r"block must be an integer >= 1, got 0"),
    (
        lambda: FixedSparsityConfig(2, num_local_blocks=4, num_global_blocks=3),
        ValueError,
        r"num_local_blocks \(4\) must be a multiple of num_global_blocks \(3\)",
    ),
    (lambda: FixedSparsityConfig(2, num_global_blocks=0), ValueError, r"num_global_blocks must be an integer >= 1"),
    (lambda: FixedSparsityConfig(2, num_local_blocks=0), ValueError, r"num_local_blocks must be an integer >= 1"),
    (
        lambda: FixedSparsityConfig(2, attention="sideways"),
        NotImplementedError,
        r"attention must be 'unidirectional' or 'bidirectional', got 'sideways'",
    ),
    (
        lambda: FixedSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True),
        ValueError,
        r"horizontal_global_attention=True needs attention='bidirectional', got 'unidirectional'",
    ),
    (
        lambda: FixedSparsityConfig(2, num_different_global_patterns=2),
        ValueError,
        r"num_different_global_patterns \(2\) > 1 needs different_layout_per_head=True",
    ),
    (
        lambda: FixedSparsityConfig(2, 16, True, 4, 2, num_different_global_patterns=3),
        ValueError,
        r"num_different_global_patterns \(3\) must be at most num_local_blocks // num_global_blocks = 4 // 2 = 2",
    ),
    (
        lambda: FixedSparsityConfig(2, 16, True, num_different_global_patterns=0),
        ValueError,
        r"num_different_global_patterns must be an integer >= 1, got 0",
    ),
    (
        lambda: VariableSparsityConfig(2, global_block_indices=[0, 4], global_block_end_indices=[2]),
        ValueError,
        r"global_block_end_indices has 1 entries but global_block_indices has 2",
    ),
    (
        lambda: VariableSparsityConfig(2, global_block_indices=[0, 4], global_block_end_indices=[2, 4]),
        ValueError,
        r"global_block_indices\[1\] \(4\) must be smaller than global_block_end_indices\[1\] \(4\)",
    ),
    (
        lambda: VariableSparsityConfig(2, global_block_indices=[-1]),
        ValueError,
        r"global_block_indices\[0\] must be an integer >= 0, got -1",
    ),
    (lambda: VariableSparsityConfig(2, local_window_blocks=[]), ValueError, r"local_window_blocks must list at least"),
    (
        lambda: VariableSparsityConfig(2, local_window_blocks=[2, 0]),
        ValueError,
        r"local_window_blocks\[1\] must be an integer >= 1, got 0",
    ),
    (lambda: VariableSparsityConfig(2, num_random_blocks=-1), ValueError, r"num_random_blocks must be an integer >= 0"),
    (lambda: VariableSparsityConfig(2, attention="causal"), NotImplementedError, r"attention must be .* got 'causal'"),
    (
        lambda: VariableSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True),
        ValueError,
        r"horizontal_global_attention=True needs attention='bidirectional'",
    ),
    (lambda: VariableSparsityConfig(2, seed=1, generator=random.Random(1)), ValueError, r"pass seed or generator"),
    (lambda: BigBirdSparsityConfig(2, generator=1), ValueError, r"generator must be a random.Random, got int"),
    (lambda: BigBirdSparsityConfig(2, attention="both"), NotImplementedError, r"attention must be .* got 'both'"),
    (
        lambda: BigBirdSparsityConfig(2, num_sliding_window_blocks=0),
        ValueError,
        r"num_sliding_window_blocks must be an integer >= 1, got 0",
    ),
    (
        lambda: BSLongformerSparsityConfig(2, global_block_indices=[1], global_block_end_indices=[2, 3]),
        ValueError,
        r"global_block_end_indices has 2 entries but global_block_indices has 1",
    ),
    (
        lambda: BSLongformerSparsityConfig(2, global_block_indices=[3], global_block_end_indices=[1]),
        ValueError,
        r"global_block_indices\[0\] \(3\) must be smaller than global_block_end_indices\[0\] \(1\)",
    ),
    (lambda: BSLongformerSparsityConfig(2, attention="causal"), NotImplementedError, r"got 'causal'"),
    (lambda: LocalSlidingWindowSparsityConfig(2, attention="causal"), NotImplementedError, r"got 'causal'"),
]


@pytest.mark.parametrize("make, error, message", CONSTRUCTION_ERRORS)
def test_construction_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


LAYOUT_ERRORS = [
    (DenseSparsityConfig(2, block=16), 40, r"seq_len \(40\) must be a positive multiple of block \(16\)"),
    (FixedSparsityConfig(2, block=16), 0, r"seq_len \(0\) must be a positive multiple of block \(16\)"),
    (
        VariableSparsityConfig(2, 4, num_random_blocks=3),
        8,
        r"num_random_blocks \(3\) must be at most the number of blocks in a row \(2\)",
    ),
    (BigBirdSparsityConfig(2, 4, num_random_blocks=3), 8, r"num_random_blocks \(3\) must be at most .* \(2\)"),
    (BigBirdSparsityConfig(2, 4, num_random_blocks=0), 8, r"num_sliding_window_blocks \(3\) must be at most .* \(2\)"),
    (BigBirdSparsityConfig(2, 4, 0, 0, 1, num_global_blocks=3), 8, r"num_global_blocks \(3\) must be at most .* \(2\)"),
    (
        BSLongformerSparsityConfig(2, 4, num_sliding_window_blocks=5),
        16,
        r"num_sliding_window_blocks \(5\) must be at most the number of blocks in a row \(4\)",
    ),
    (LocalSlidingWindowSparsityConfig(2, 4), 8, r"num_sliding_window_blocks \(3\) must be at most .* \(2\)"),
]


@pytest.mark.parametrize("config, seq_len, message", LAYOUT_ERRORS)
def test_layout_errors(config, seq_len, message):
    with pytest.raises(ValueError, match=message):
        config.make_layout(seq_len)


# --- dense_mask and layout_density --------------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(all_configs()), ids=lambda c: f"{type(c).__name__}-{c.attention}")
@pytest.mark.parametrize("block", [1, 3])
def test_dense_mask_agrees_with_layout(config, block):
    layout = config.make_layout(16)
    for causal in [False, True]:
        mask = dense_mask(layout, block, causal=causal)
        seq = layout.shape[-1] * block
        assert mask.dtype == torch.bool and mask.shape == (layout.shape[0], seq, seq)
        for h, i, j in itertools.product(range(layout.shape[0]), range(seq), range(seq)):
            assert mask[h, i, j] == (layout[h, i // block, j // block] == 1 and (not causal or j <= i))


def test_dense_mask_and_density_small_cases():
    layout = grid("10", "11")[None]
    assert dense_mask(layout, 2).int().tolist() == [[[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]]
    assert dense_mask(layout, 2, causal=True).int().tolist() == [
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    ]
    assert torch.equal(dense_mask(layout[0], 1), layout[0].bool())  # a single head's [nb, nb] works too
    assert layout_density(layout) == 0.75
    assert layout_density(torch.zeros(2, 3, 3)) == 0.0
    with pytest.raises(ValueError, match=r"layout of shape \(0, 0\) has no blocks"):
        layout_density(torch.zeros(0, 0))
    with pytest.raises(ValueError, match=r"block must be an integer >= 1, got 0"):
        dense_mask(layout, 0)
    with pytest.raises(ValueError, match=r"layout must be \[..., num_blocks, num_blocks\], got shape \(2, 3\)"):
        dense_mask(torch.ones(2, 3), 1)
