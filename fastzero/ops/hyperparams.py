"""The base of each kernel family's hyperparameter dataclass.

A family states its hyperparameters once, as the fields of a frozen
dataclass (``AdamHyperparams``, ``LambHyperparams``); everything else is
derived from the fields: the keywords the optimizer classes accept, their
torch.optim param-group keys, the type and range checks, and the C struct the
native kernels take (:meth:`Hyperparams.c_struct`, field for field in
declaration order: ``float`` -> ``double``, ``bool`` -> ``int32_t``). Adding a
hyperparameter is a field here, a line in the family's reference and its
kernels; no other file changes.

Param groups keep torch.optim's ``betas`` pair for ``beta1``/``beta2``, so
torch's schedulers and state dicts keep working.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from typing import Any, ClassVar

_C_TYPES = {"float": ctypes.c_double, "bool": ctypes.c_int32, "int": ctypes.c_int64}


@dataclasses.dataclass(frozen=True)
class Hyperparams:
    """Subclasses declare fields (``float``, ``bool`` or ``int``, each with a
    default) and may override :meth:`validate` for ranges."""

    family: ClassVar[str] = ""
    labels: ClassVar[dict[str, str]] = {"lr": "learning rate"}  # how errors name a field, where not its name
    # The ranges of the fields the optimizer families share: (low, high or None, high excluded).
    ranges: ClassVar[dict[str, tuple[float, float | None, bool]]] = {
        "lr": (0.0, None, False),
        "beta1": (0.0, 1.0, True),
        "beta2": (0.0, 1.0, True),
        "eps": (0.0, None, False),
        "weight_decay": (0.0, None, False),
        "max_grad_norm": (0.0, None, False),
    }

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, label = getattr(self, f.name), self.labels.get(f.name, f.name)
            label = label if label == f.name else f"{label} ({f.name})"
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            if kind == "bool":
                if not (isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))):
                    raise TypeError(f"{self.family}: {label} must be True or False, got {value!r}")
                object.__setattr__(self, f.name, bool(value))
            elif kind in ("float", "int"):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    what = type(value).__name__
                    raise TypeError(f"{self.family}: {label} must be a real number, got {what} {value!r}")
                if kind == "int" and not isinstance(value, int):
                    raise TypeError(f"{self.family}: {label} must be an integer, got {value!r}")
                if kind == "float":
                    value = float(value)
                    if not math.isfinite(value):
                        raise ValueError(f"{self.family}: invalid {label} {value}: it must be a finite number")
                object.__setattr__(self, f.name, value)
        self.validate()

    def validate(self) -> None:
        """Range checks (:attr:`ranges`, and a subclass's own); a ValueError names the field."""
        for name in self.names():
            if name in self.ranges:
                low, high, open_high = self.ranges[name]
                check_range(
                    self.family, self.labels.get(name, name), getattr(self, name), low, high, open_high=open_high
                )

    # -- torch.optim param groups -------------------------------------------------------
    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> Hyperparams:
        """The hyperparameters from keywords: field names, or ``betas`` for
        (beta1, beta2). An unknown keyword is an error that lists the known."""
        if "betas" in kwargs:
            if "beta1" in kwargs or "beta2" in kwargs:
                raise TypeError(f"{cls.family}: pass betas=(beta1, beta2) or beta1=/beta2=, not both")
            kwargs["beta1"], kwargs["beta2"] = cls._betas(kwargs.pop("betas"))
        unknown = sorted(set(kwargs) - set(cls.names()))
        if unknown:
            raise TypeError(
                f"{cls.family}: unknown hyperparameter(s) {', '.join(unknown)}; known: betas, {', '.join(cls.names())}"
            )
        return cls(**kwargs)

    @classmethod
    def from_group(cls, group: dict) -> Hyperparams:
        """This family's hyperparameters of a param group (a scheduler may
        have changed ``lr`` since the last step, so read it every step)."""
        kwargs = {n: group[n] for n in cls.names() if n in group}
        if "betas" in group:
            kwargs["beta1"], kwargs["beta2"] = cls._betas(group["betas"])
        return cls(**kwargs)

    @classmethod
    def _betas(cls, betas: Any) -> tuple[Any, Any]:
        """(beta1, beta2) of a ``betas`` value, or a ValueError naming it."""
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise ValueError(f"{cls.family}: betas must be a pair (beta1, beta2), got {betas!r}")
        return betas[0], betas[1]

    def group_defaults(self) -> dict[str, Any]:
        """The param-group keys: torch.optim's ``betas`` pair, the rest by name."""
        out = dataclasses.asdict(self)
        if "beta1" in out:
            out = {"betas": (out.pop("beta1"), out.pop("beta2")), **out}
        return out

    # -- the C ABI ---------------------------------------------------------------------
    @classmethod
    @functools.cache
    def c_struct_type(cls) -> type[ctypes.Structure]:
        """A ctypes.Structure laid out as the family's C struct."""
        fields = []
        for f in dataclasses.fields(cls):
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            fields.append((f.name, _C_TYPES[kind]))
        return type(f"{cls.__name__}Struct", (ctypes.Structure,), {"_fields_": fields})

    def c_struct(self) -> ctypes.Structure:
        """These values as the family's C struct (pass ``ctypes.byref`` or ``bytes``)."""
        return self.c_struct_type()(*(getattr(self, n) for n in self.names()))


def check_range(family: str, name: str, value: float, low: float, high: float | None = None, *, open_high=False):
    """``low <= value`` (``< high`` or ``<= high``), or a ValueError naming the field."""
    if value < low or (high is not None and (value >= high if open_high else value > high)):
        bound = "" if high is None else (f" and < {high}" if open_high else f" and <= {high}")
        raise ValueError(f"{family}: invalid {name} {value}: it must be >= {low}{bound}")
