"""The Adam family's backends, fastest first (see fastzero.ops.backend for
the rule that picks one). Each target takes the lists, ``step``, ``hp``,
``grad_scale`` and ``param_copies`` (device backends: ``found_inf`` too) of
lists already checked."""

from fastzero.ops.backend import Backend, Family, always, cpu_status, cuda_status, triton_status

FAMILY = Family(
    "adam",
    "Adam (FusedAdam, CPUAdam)",
    [
        Backend("cuda", ("cuda",), ("cuda",), cuda_status, "fastzero.ops.adam.cuda:launch"),
        Backend("triton", ("cuda",), ("cuda", "cpu"), triton_status, "fastzero.triton_kernels.adam:launch"),
        Backend("cpu", ("cpu",), ("cpu",), cpu_status, "fastzero.ops.adam.cpu:launch"),
        Backend("reference", ("cpu", "cuda"), ("cpu", "cuda"), always, "fastzero.ops.adam.reference:adam_step"),
    ],
)
