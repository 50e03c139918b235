"""The engine's optimizer: one of fastzero's fused optimizers over what the
rank updates (the model's params at stage 0, its shard's chunks above), built
from the config's ``optimizer`` section or from the optimizer the script
passed (torch.optim.Adam/AdamW and fastzero's own are taken over with their
hyperparameters, so a script switches without edits). Which optimizer works
with which stage and with offload is :data:`fastzero.config.OPTIMIZER_RULES`.
Any other ``torch.optim.Optimizer`` runs unfused over the rank's fp32 master
shard (:mod:`fastzero.runtime.client_optimizer`), with DeepSpeed's
``zero_allow_untested_optimizer`` and ``zero_force_ds_cpu_optimizer``."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from fastzero.config import Config, ConfigError, ConfigNotSupported, check_optimizer
from fastzero.ops import CPUAdam, FusedAdam, FusedLamb
from fastzero.runtime.client_optimizer import ClientOptimizer
from fastzero.runtime.offload import OffloadedAdam
from fastzero.runtime.onebit_adam import OneBitAdam
from fastzero.runtime.onebit_lamb import OneBitLamb
from fastzero.runtime.zero_one_adam import ZeroOneAdam

_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "adamw_mode")
_LAMB_KEYS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "bias_correction",
    "max_grad_norm",
    "max_coeff",
    "min_coeff",
    "eps_inside_sqrt",
)
_ONEBIT_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction")
_ZERO_ONE_KEYS = ("lr", "betas", "eps", "weight_decay")
_ONEBIT_LAMB_KEYS = ("lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff")
_GROUP_KEYS = {
    "Lamb": _LAMB_KEYS,
    "OneBitAdam": _ONEBIT_KEYS,
    "ZeroOneAdam": _ZERO_ONE_KEYS,
    "OneBitLamb": _ONEBIT_LAMB_KEYS,
}
_ONEBIT_IGNORED = ("comm_backend_name", "cuda_aware")  # DeepSpeed's backend flags: any torch.distributed backend works


# the fastzero class of each optimizer name of fastzero.config.OPTIMIZER_RULES
_CLASSES = {
    "Adam": FusedAdam,
    "AdamW": FusedAdam,
    "Lamb": FusedLamb,
    "OneBitAdam": OneBitAdam,
    "ZeroOneAdam": ZeroOneAdam,
    "OneBitLamb": OneBitLamb,
}


def _from_client(client: torch.optim.Optimizer, no_master: bool) -> tuple[str, dict, list[dict]] | None:
    """(optimizer name, constructor kwargs, per-group hyperparameters) that
    reproduce `client`'s math with a fused optimizer, or None: it runs as it is
    (:class:`ClientOptimizer`). `no_master` (bf16 params without fp32
    masters): fastzero's Adam writes them with stochastic rounding."""
    groups = client.param_groups
    if isinstance(client, OneBitAdam):
        kwargs = dict(freeze_step=client.freeze_step, max_grad_norm=client.max_grad_norm)
        return "OneBitAdam", kwargs, [{k: g[k] for k in _ONEBIT_KEYS if k in g} for g in groups]
    if isinstance(client, ZeroOneAdam):
        keys = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "max_grad_norm")
        kwargs = {k: getattr(client, k) for k in keys}
        return "ZeroOneAdam", kwargs, [{k: g[k] for k in _ZERO_ONE_KEYS if k in g} for g in groups]
    if isinstance(client, OneBitLamb):
        keys = ("freeze_step", "max_grad_norm", "coeff_beta", "factor_max", "factor_min", "factor_threshold")
        kwargs = {k: getattr(client, k) for k in keys}
        return "OneBitLamb", kwargs, [{k: g[k] for k in _ONEBIT_LAMB_KEYS if k in g} for g in groups]
    if isinstance(client, FusedLamb):
        return "Lamb", {}, [{k: g[k] for k in _LAMB_KEYS if k in g} for g in groups]
    if isinstance(client, (FusedAdam, CPUAdam)):  # with its state format (bf16's seed, int8's block size)
        if client.bf16_stochastic_round and not no_master:
            raise ConfigError(
                f"optimizer={type(client).__name__}(bf16_stochastic_round=True) writes bf16 params kept without an "
                "fp32 master, and the engine keeps fp32 masters: set bf16.bf16_master_weights_and_grads: true in "
                "the config (bf16.enabled too), or pass bf16_stochastic_round=False"
            )
        fmt = dict(state_format=client.state_format, seed=client.seed, block_size=client.block_size)
        kwargs = {k: v for k, v in fmt.items() if v is not None}
        return "Adam", _rounding(kwargs, no_master), [{k: g[k] for k in _ADAM_KEYS if k in g} for g in groups]
    if type(client) in (torch.optim.Adam, torch.optim.AdamW):
        if any(g.get(key) for g in groups for key in ("amsgrad", "maximize")):
            return None  # the fused Adam does not implement them: torch's own Adam runs
        adamw = isinstance(client, torch.optim.AdamW) or bool(client.defaults.get("decoupled_weight_decay"))
        keep = ("lr", "betas", "eps", "weight_decay")
        hypers = [dict({k: g[k] for k in keep}, adamw_mode=adamw) for g in groups]
        return "AdamW" if adamw else "Adam", _rounding({}, no_master), hypers
    return None


def _rounding(kwargs: dict, no_master: bool) -> dict:
    """A client Adam's kwargs with how bf16 params without fp32 masters are
    written: stochastic rounding (bf16.bf16_master_weights_and_grads' default)."""
    return {**kwargs, "bf16_stochastic_round": True} if no_master else kwargs


_warned_untested: set[str] = set()  # class names warned about, once per process as DeepSpeed does


def _client_optimizer(
    cfg: Config, client: torch.optim.Optimizer, groups: list[dict], master_weights: bool
) -> ClientOptimizer:
    """`client` rebuilt over the shard, under DeepSpeed's rules: at stages
    1-3 only with ``zero_allow_untested_optimizer``, with offload only with
    ``zero_force_ds_cpu_optimizer: false``."""
    zero, name = cfg.zero_optimization, type(client).__name__
    if zero.stage >= 1 and not cfg.zero_allow_untested_optimizer:
        raise ConfigError(
            f"optimizer={name} at zero_optimization.stage {zero.stage}: fastzero has no fused kernel for it and would "
            "run it unfused over each rank's fp32 shard, untested for this class; set "
            "zero_allow_untested_optimizer: true to run it (DeepSpeed's key), or use Adam/AdamW"
        )
    offload = zero.offload_optimizer
    if offload.device == "cpu" and cfg.zero_force_ds_cpu_optimizer:
        raise ConfigError(
            f"optimizer={name} with zero_optimization.offload_optimizer: the offloaded step is fastzero's CPU Adam "
            "(zero_force_ds_cpu_optimizer is true, DeepSpeed's default); set zero_force_ds_cpu_optimizer: false to "
            f"run {name} itself on the rank's CPU shard, or use Adam/AdamW"
        )
    if zero.stage >= 1 and name not in _warned_untested:
        _warned_untested.add(name)
        warnings.warn(
            f"optimizer={name}: not one fastzero takes over; it runs unfused over each rank's fp32 shard "
            "(zero_allow_untested_optimizer: true)",
            stacklevel=4,
        )
    return ClientOptimizer(
        client,
        groups,
        master_weights=master_weights,
        offload=offload.device == "cpu",
        pin_memory=offload.pin_memory,
        sub_group_size=zero.sub_group_size,
    )


def param_state(optimizer: torch.optim.Optimizer, p: Tensor) -> dict[str, Tensor]:
    """The optimizer's state for `p` (``exp_avg``, ``exp_avg_sq`` and, with
    master weights, ``master_param``), created as its first step would create
    it when no step has run yet (a checkpoint saved or loaded before the
    first step)."""
    return optimizer.init_state(p)


def build_optimizer(
    cfg: Config, groups: list[dict], shard_params: list[list[Tensor]], client=None, *, master_weights: bool
) -> torch.optim.Optimizer:
    """`groups` are the training's param groups (with any per-group
    hyperparameters), `shard_params` what the rank updates for each;
    `master_weights`: fp32 masters of 16-bit params (not with
    ``bf16.bf16_master_weights_and_grads``, whose bf16 params are their own
    masters, written with stochastic rounding by default)."""
    opt = cfg.optimizer
    if client is not None and opt.type:
        fmt = opt.params.get("state_format", "fp32")
        hint = (
            f"; for {fmt} states with your own param groups pass fastzero.ops.FusedAdam(..., state_format={fmt!r}) "
            "as the optimizer (its format is kept)"
            if fmt != "fp32"
            else ""
        )
        raise ConfigError(
            f"an optimizer was passed to initialize() and the config has an optimizer section: keep one{hint}"
        )
    if client is not None and not isinstance(client, torch.optim.Optimizer):
        if not callable(client):
            raise ConfigError(f"optimizer={client!r}: pass a torch.optim.Optimizer or a callable(params) -> one")
        client = client([{**g, "params": g["params"]} for g in groups])
    no_master = cfg.bf16.bf16_master_weights_and_grads
    if client is not None:
        taken = _from_client(client, no_master)
        if taken is None and no_master:
            raise ConfigNotSupported(
                f"optimizer={type(client).__name__} with bf16.bf16_master_weights_and_grads: fastzero runs it unfused "
                "over fp32 masters of the shard, and writing bf16 params without a master (stochastic rounding) is "
                "fastzero's Adam's and AdamW's: pass torch.optim.Adam/AdamW or fastzero.ops.FusedAdam, or set "
                "bf16.bf16_master_weights_and_grads: false"
            )
        if taken is None:
            return _client_optimizer(
                cfg, client, [{**g, "params": p} for g, p in zip(groups, shard_params)], master_weights
            )
        name, kwargs, hypers = taken
    elif not opt.type:
        raise ConfigError("no optimizer: add an 'optimizer' section to the config or pass optimizer= to initialize()")
    else:
        name, params = opt.type, dict(opt.params)
        if name in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
            for key in _ONEBIT_IGNORED:
                params.pop(key, None)
        elif name in ("Adam", "AdamW"):
            params["adam_w_mode"] = params.pop("adam_w_mode", True) if name == "Adam" else True
        kwargs = params
        keys = _GROUP_KEYS.get(name, ("lr", "betas", "eps", "weight_decay"))
        hypers = [{k: g[k] for k in keys if k in g} for g in groups]  # per-group overrides of the config
    offload = cfg.zero_optimization.offload_optimizer
    check_optimizer(name, cfg.zero_optimization.stage, offload=offload.device != "none", no_master=no_master)
    cls = _CLASSES[name]
    groups = [{**h, "params": p} for h, p in zip(hypers, shard_params)]
    if offload.device == "cpu":  # OPTIMIZER_RULES allows it for the Adam family only: CPUAdam's math
        if "adam_w_mode" in kwargs:
            kwargs["adamw_mode"] = kwargs.pop("adam_w_mode")
        return OffloadedAdam(
            groups,
            master_weights=master_weights,
            pin_memory=offload.pin_memory,
            sub_group_size=cfg.zero_optimization.sub_group_size,
            **kwargs,
        )
    return cls(groups, master_weights=master_weights, **kwargs)
