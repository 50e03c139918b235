"""Plain-PyTorch references of 0/1 Adam and 1-bit LAMB (DeepSpeed's math,
written from its zoadam.py and lamb.py with their counters and if-chains, not
from fastzero's code) over several simulated ranks, and the 1-bit compressed
all-reduce they use, simulated with fastzero's compression reference. The
tiny model and the per-rank data the tests and tests/workers/onebit_family.py
share live here too."""

from __future__ import annotations

import torch

from fastzero.ops.reference import onebit as ref

LRS = (1e-2, 3e-3)  # the two param groups' learning rates


def model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3))


def param_groups(m: torch.nn.Sequential) -> list[dict]:
    return [{"params": list(m[0].parameters()), "lr": LRS[0]}, {"params": list(m[2].parameters()), "lr": LRS[1]}]


def set_grads(m: torch.nn.Sequential, rank: int, step: int) -> None:
    """The local gradient of `rank` at `step`: its own data."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 3, generator=gen)
    m.zero_grad()
    torch.nn.functional.mse_loss(m(x), y).backward()


def flat(ts) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in ts])


def padded(n: int, world: int) -> int:
    return -(-n // (8 * world)) * (8 * world)


def allreduce_1bit(xs: list[torch.Tensor], workers: list, servers: list) -> torch.Tensor:
    """The average of the ranks' padded `xs`: each rank compresses with its worker error, one scale per
    rank-sized chunk; the server of chunk c (rank c) averages the chunks, compresses with its server error;
    everyone gets the server chunks. The errors (lists by rank) are replaced."""
    world, chunk = len(xs), xs[0].numel() // len(xs)
    rows = []
    for r, x in enumerate(xs):
        bits, scales, workers[r] = ref.compress(x, workers[r], chunks=world)
        rows.append(ref.decompress(bits, scales))
    out = []
    for c in range(world):
        avg = torch.stack([row[c * chunk : (c + 1) * chunk] for row in rows]).mean(0)
        bits, scales, servers[c] = ref.compress(avg, servers[c])
        out.append(ref.decompress(bits, scales))
    return torch.cat(out)


class _Group:
    """One param group on every rank: its params (by rank), flat states and errors."""

    def __init__(self, params_by_rank: list[list[torch.Tensor]], lr: float) -> None:
        self.params, self.lr, world = params_by_rank, lr, len(params_by_rank)
        self.n = sum(p.numel() for p in params_by_rank[0])
        self.padded = padded(self.n, world)
        zeros = lambda k: torch.zeros(k)  # noqa: E731
        self.m = [zeros(self.n) for _ in range(world)]
        self.v = zeros(self.n)
        self.u = [zeros(self.n) for _ in range(world)]
        self.workers = [zeros(self.padded) for _ in range(world)]
        self.servers = [zeros(self.padded // world) for _ in range(world)]

    def grads(self) -> list[torch.Tensor]:
        return [flat(p.grad for p in ps) for ps in self.params]

    def p(self, r: int) -> torch.Tensor:
        return flat(self.params[r])

    def set_p(self, r: int, values: torch.Tensor) -> None:
        off = 0
        with torch.no_grad():
            for p in self.params[r]:
                p.copy_(values[off : off + p.numel()].view_as(p))
                off += p.numel()

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.zeros(self.padded - self.n)])

    def exchange(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return allreduce_1bit([self.pad(x) for x in xs], self.workers, self.servers)[: self.n]

    def zero_errors(self) -> None:
        for e in (*self.workers, *self.servers):
            e.zero_()


class ZeroOneAdamRef:
    """DeepSpeed's ZeroOneAdam.step, one call per step for all ranks (their
    grads set), with t counting the steps taken."""

    def __init__(self, models, lrs=LRS, wd=0.0, betas=(0.9, 0.999), eps=1e-8, var_freeze_step=100000,
                 var_update_scaler=16, local_step_scaler=32678, local_step_clipper=16):  # fmt: skip
        layers = lambda m: (list(m[0].parameters()), list(m[2].parameters()))  # noqa: E731
        self.groups = [_Group([layers(m)[i] for m in models], lr) for i, lr in enumerate(lrs)]
        self.wd, self.betas, self.eps = wd, betas, eps
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.var_interval, self.var_counter, self.local_step_interval, self.local_step_counter = 1, 0, 1, 0
        self.lrs = [0.0 for _ in self.groups]
        self.t = 0

    def step(self) -> None:
        self.t += 1
        t, (b1, b2), eps, wd = self.t, self.betas, self.eps, self.wd
        frozen = t > self.var_freeze_step
        if t == self.var_freeze_step + 1:
            for g in self.groups:
                g.zero_errors()
        world = len(self.groups[0].params)
        for gi, g in enumerate(self.groups):
            grads, lr = g.grads(), g.lr
            if not frozen and t % self.var_interval == 0:
                avg = torch.stack(grads).mean(0)
                g.m = [b1 * g.m[0] + (1 - b1) * avg] * world
                g.v = b2 * g.v + (1 - b2) * avg * avg
                for r in range(world):
                    g.set_p(r, g.p(r) * (1 - lr * wd) - lr * g.m[r] / (g.v.sqrt() + eps))
            elif not frozen:
                mean = g.exchange(grads)
                m = b1 * g.m[0] + (1 - b1) * mean
                m[g.v == 0] = 0  # exp_avg_mask
                g.m = [m] * world
                for r in range(world):
                    g.set_p(r, g.p(r) - lr * (m / (g.v.sqrt() + eps) + wd * g.p(r)))
            else:
                self.lrs[gi] += lr
                for r in range(world):
                    g.m[r] = b1 * g.m[r] + (1 - b1) * grads[r]
                    g.m[r][g.v == 0] = 0  # exp_avg_mask, on the local momentum too
                    update = g.m[r] / (g.v.sqrt() + eps) + wd * g.p(r)
                    g.set_p(r, g.p(r) - lr * update)
                    g.u[r] = g.u[r] - lr * update
                if t % self.local_step_interval == 0:
                    for r in range(world):
                        g.set_p(r, g.p(r) - g.u[r])
                        g.u[r] = g.u[r] * (g.v.sqrt() + eps)
                    mean = g.exchange(g.u)
                    mean[g.v == 0] = 0
                    for r in range(world):
                        g.m[r] = -(mean / self.lrs[gi])
                        g.set_p(r, g.p(r) + mean / (g.v.sqrt() + eps))
                        g.u[r] = torch.zeros(g.n)
                    self.lrs[gi] = 0.0
        if not frozen:
            if t % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
        else:
            self.local_step_counter += 1
            if self.local_step_counter == self.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(self.local_step_clipper, self.local_step_interval * 2)


class OneBitLambRef:
    """DeepSpeed's OnebitLamb.step, one call per step for all ranks (their
    grads set), with t counting the steps taken."""

    def __init__(self, models, lrs=LRS, wd=0.0, betas=(0.9, 0.999), eps=1e-8, freeze_step=100000, max_coeff=10.0,
                 min_coeff=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5, factor_threshold=0.1):  # fmt: skip
        layers = lambda m: (list(m[0].parameters()), list(m[2].parameters()))  # noqa: E731
        self.groups = [_Group([layers(m)[i] for m in models], lr) for i, lr in enumerate(lrs)]
        self.wd, self.betas, self.eps, self.freeze_step = wd, betas, eps, freeze_step
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.sizes = [[p.numel() for p in g.params[0]] for g in self.groups]
        self.lamb_coeff_freeze = [[0.0] * len(s) for s in self.sizes]
        self.last_factor = [[1.0] * len(s) for s in self.sizes]
        self.scaling_coeff = None
        self.fresh = [None for _ in self.groups]
        self.coeffs: list[float] = []
        self.t = 0

    def _pieces(self, gi: int, x: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(x, self.sizes[gi]))

    def step(self) -> None:
        self.t += 1
        t, (b1, b2), eps, wd = self.t, self.betas, self.eps, self.wd
        world = len(self.groups[0].params)
        self.coeffs = []
        if t > self.freeze_step and self.scaling_coeff is None:
            scales = [
                [float(m.norm() / m.numel() ** 0.5) for m in self._pieces(gi, g.m[0])]
                for gi, g in enumerate(self.groups)
            ]
            united = sum(sum(s) for s in scales) / sum(len(s) for s in scales)
            self.scaling_coeff = [[united / s for s in group] for group in scales]
        for gi, g in enumerate(self.groups):
            grads, lr = g.grads(), g.lr
            if t <= self.freeze_step:
                avg = torch.stack(grads).mean(0)
                g.m = [b1 * g.m[0] + (1 - b1) * avg] * world
                g.v = b2 * g.v + (1 - b2) * avg * avg
                if t == self.freeze_step:
                    self.fresh[gi] = g.v.clone()
                new_p = []
                for i, (m, v, p) in enumerate(
                    zip(self._pieces(gi, g.m[0]), self._pieces(gi, g.v), self._pieces(gi, g.p(0)))
                ):
                    weight_norm = p.pow(2).sum().sqrt()
                    update = m / (v.sqrt() + eps)
                    if wd > 0.0:
                        update = update + wd * p
                    update_norm = update.pow(2).sum().sqrt()
                    coeff = 1.0
                    if weight_norm != 0 and update_norm != 0:
                        coeff = (weight_norm / update_norm).item()
                        if coeff > self.max_coeff:
                            coeff = self.max_coeff
                        if coeff < self.min_coeff:
                            coeff = self.min_coeff
                    if coeff != 1.0:
                        c = self.lamb_coeff_freeze[gi][i]
                        self.lamb_coeff_freeze[gi][i] = self.coeff_beta * c + (1 - self.coeff_beta) * coeff
                    self.coeffs.append(coeff)
                    new_p.append(p - lr * coeff * update)
                for r in range(world):
                    g.set_p(r, torch.cat(new_p))
                continue
            scaling = torch.cat([torch.full((n,), s) for n, s in zip(self.sizes[gi], self.scaling_coeff[gi])])
            last = g.m[0]
            mean = g.exchange([(b1 * last + (1 - b1) * grads[r]) * scaling for r in range(world)]) / scaling
            mean[g.v == 0] = 0  # exp_avg_mask
            g.m = [mean] * world
            reconstructed = (mean - last * b1) / (1 - b1)
            self.fresh[gi] = b2 * self.fresh[gi] + (1 - b2) * reconstructed * reconstructed
            new_p = []
            pieces = zip(*(self._pieces(gi, x) for x in (mean, g.v, self.fresh[gi], g.p(0))))
            for i, (m, v, fresh, p) in enumerate(pieces):
                denom = v.sqrt() + eps
                prelim = m / denom
                update = prelim + wd * p if wd > 0.0 else prelim
                update_norm = update.pow(2).sum().sqrt()
                factor = (denom / (fresh.sqrt() + eps)).max().item()
                if wd > 0.0:
                    ratio = min(1.0, (prelim.pow(2).sum().sqrt() / update_norm).item())
                    factor = factor * ratio + (1.0 - ratio)
                if factor > self.factor_max:
                    factor = self.factor_max
                if factor < self.factor_min:
                    factor = self.factor_min
                previous = self.last_factor[gi][i]
                if factor > previous * (1.0 + self.factor_threshold):
                    factor = previous * (1.0 + self.factor_threshold)
                if factor < previous * (1.0 - self.factor_threshold):
                    factor = previous * (1.0 - self.factor_threshold)
                self.last_factor[gi][i] = factor
                coeff = self.lamb_coeff_freeze[gi][i] * factor
                self.coeffs.append(coeff)
                new_p.append(p - lr * coeff * update)
            for r in range(world):
                g.set_p(r, torch.cat(new_p))
