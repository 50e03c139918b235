"""pytest-benchmark over the suite's own cases (the quick sizes), for users
who keep pytest-benchmark's autosave, compare and histogram tools:

    python -m pytest bench/ --benchmark-only --benchmark-autosave

The cases, providers and reference checks are the harness's (bench/kernels);
nothing here restates them. Verdicts against a baseline belong to
``python -m bench.run --baseline``, which compares ratios measured side by
side, not raw times.
"""

import pytest

from . import kernels
from .harness import Unavailable


def _cases():
    for family in kernels.families():
        for case in family.cases(quick=True):
            for provider in case.providers:
                yield pytest.param(case, provider, id=f"{family.name}/{case.name}/{provider.name}")


@pytest.mark.parametrize("case, provider", list(_cases()))
def test_kernel(benchmark, case, provider):
    try:
        runner = provider.make()
    except Unavailable as exc:
        pytest.skip(str(exc))
    if runner.check is not None:
        runner.check()
    benchmark.group = f"{case.kernel}/{case.name}"
    benchmark.extra_info.update(kernel=case.kernel, case=case.name, numel=case.numel, bytes=case.bytes)
    benchmark(runner.step)
