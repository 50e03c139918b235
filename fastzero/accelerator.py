"""DeepSpeed's ``deepspeed.accelerator.get_accelerator()``, for scripts
written against it (DeepSpeed's examples call ``get_accelerator().device_name()``,
``.current_device_name()``, ``.synchronize()``, ...): the device this process
trains on, CUDA when there is one, else the CPU; ``DS_ACCELERATOR`` (``cuda``
or ``cpu``) chooses, as it does for DeepSpeed. fastzero itself never needs it.
"""

from __future__ import annotations

import os
import resource

import torch

_NAMES = ("cuda", "cpu")
_current: Accelerator | None = None


class Accelerator:
    """The calls DeepSpeed scripts make on their accelerator, for one device kind."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cuda = name == "cuda"

    # -- devices ----------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    # -- random numbers ---------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        (torch.cuda.manual_seed if self._cuda else torch.manual_seed)(seed)

    def manual_seed_all(self, seed: int) -> None:
        (torch.cuda.manual_seed_all if self._cuda else torch.manual_seed)(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    # -- memory: the GPU's allocator, or the process's resident set on the CPU ------------------
    def memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        with open("/proc/self/statm") as f:  # resident pages
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    # -- dtypes and tensors -----------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16] + ([torch.bfloat16] if self.is_bf16_supported() else [])

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name


def get_accelerator() -> Accelerator:
    """The accelerator of this process (made on first call): ``DS_ACCELERATOR``
    if set (``cuda`` or ``cpu``), else CUDA when available, else the CPU."""
    global _current
    if _current is None:
        wanted = os.environ.get("DS_ACCELERATOR", "").strip().lower()
        if wanted and wanted not in _NAMES:
            raise ValueError(f"DS_ACCELERATOR={wanted!r}: fastzero runs on {' or '.join(_NAMES)}; unset it or pick one")
        if wanted == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("DS_ACCELERATOR=cuda, but no CUDA device is available; unset it or set it to cpu")
        _current = Accelerator(wanted or ("cuda" if torch.cuda.is_available() else "cpu"))
    return _current
