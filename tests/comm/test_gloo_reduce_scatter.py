"""Over Gloo, Comm.reduce_scatter is an all-to-all and a sum in rank order
(Gloo's own reduce-scatter took 2.4-3.8x as long: docs/zero.md): the
result equals the rank-order sum bit for bit, for every dtype."""

import pytest

from tests.dist import run_ranks
from tests.paths import WORKERS


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_reduce_scatter_is_the_rank_order_sum(tmp_path, world):
    run_ranks(WORKERS / "gloo_reduce_scatter.py", world, [tmp_path / "out"], timeout=300)
    for r in range(world):
        assert (tmp_path / f"out.rank{r}").read_text() == "12"
