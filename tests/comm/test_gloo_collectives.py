"""Over Gloo, Comm.reduce_scatter is an all-to-all and a sum in rank order
(Gloo's own reduce-scatter took 1.3-3.8x as long: docs/zero.md): the
result equals the rank-order sum bit for bit, for every dtype. Comm.all_gather
is sends and receives (Gloo's own all-gather took 1.1-2.5x as long): the
result equals torch's all-gather, several in flight, on the world and a group."""

import pytest

from tests.dist import run_ranks
from tests.paths import WORKERS


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_reduce_scatter_and_all_gather(tmp_path, world):
    run_ranks(WORKERS / "gloo_collectives.py", world, [tmp_path / "out"], timeout=300)
    for r in range(world):
        # 12 reduce-scatters, 16 all-gathers on the world, 16 more on the group of ranks 1..
        assert (tmp_path / f"out.rank{r}").read_text() == str(12 + 16 + (16 if r > 0 else 0))
