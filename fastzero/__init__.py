"""fastzero: fast kernels and a thin ZeRO runtime for training large models.

The kernels are in :mod:`fastzero.ops` (``from fastzero.ops import CPUAdam``);
``fastzero.initialize(model=..., config=...)`` builds the training engine
(DeepSpeed's API: ``import fastzero as deepspeed`` works for the common calls).
"""

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """See :func:`fastzero.runtime.engine.initialize`."""
    from fastzero.runtime.engine import initialize as _initialize

    return _initialize(*args, **kwargs)


def init_distributed(dist_backend: str | None = None, timeout_s: float | None = None, **_ignored):
    """Joins the process group from the launcher's environment (DeepSpeed's
    ``deepspeed.init_distributed``)."""
    from fastzero.comm.env import init_distributed as _init

    return _init(dist_backend, timeout_s)
