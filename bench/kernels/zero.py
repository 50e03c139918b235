"""ZeRO training steps at world size 2 over Gloo, fastzero beside its peers
on one model, data and world size: LAYERS x (Linear(w, w) + GELU), fp32,
micro-batch 64 per rank, MSE loss on fixed random data, AdamW. Three
families share this module (bench/kernels/__init__.py names them):

* ``zero``: ``fastzero.initialize`` at stages 0, 1 and 2 beside PyTorch DDP,
  FSDP2 (``fully_shard``, resharding after forward off and on) and DeepSpeed
  ZeRO 1 and 2 where it imports;
* ``zero3``: fastzero stage 3 with its recorded-order prefetch and without it
  (``stage3_prefetch_bucket_size`` 0) beside FSDP2 full sharding
  (``reshard_after_forward=True``) and DeepSpeed stage 3;
* ``offload``: fastzero with ``offload_optimizer: {device: cpu}`` at stages 2
  and 3 beside FSDP2 with ``CPUOffloadPolicy`` and DeepSpeed's ZeRO-Offload
  (DeepSpeedCPUAdam) at stages 2 and 3.

Each variant is its own 2-process job (bench/zero_worker.py): the processes
time their own steps, so these families do not use the harness's in-process
rounds; ``measure`` is the hook bench.run calls instead. The jobs run one
after another, so a neighbour's burst can hit one and not the others: the
only gated figure of a family is one fastzero variant's speed relative to
the fastest of its named peers in the same run, never an absolute time.

Reported per variant: median ms/step and its spread, samples/s (global batch
/ step time), model-state bytes per rank (fastzero: its memory_breakdown();
peers: the storages of params, grads and optimizer state they hold after a
step), the peak RSS growth over the timed steps (every provider alike), and
for fastzero: the ZeRO formula for fp32 and the runtime's own figures (see
each family's legend).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..family import Family, Settings
from ..harness import Case, Provider, Rows, Timing, self_timed
from ..jobs import JobFailed, run_ranks
from ..tables import fmt, row, skipped_lines

WORLD = 2
LAYERS = 4
MICRO = 64
WIDTH, QUICK_WIDTH = 1024, 512
# step times of a 2-process job on 2 cores spread 10-20% (IQR/median): a job times 3 steps per --repeats
# (45 by default), more than a kernel call needs, for a steady median
STEPS_PER_REPEAT = 3
BUCKET = 2_000_000  # elements: 3 buckets at width 1024
PREFETCH = 2_000_000  # stage 3: elements gathered ahead, two layers at width 1024
PERSIST = 100_000  # stage 3: params smaller than this stay whole (the biases)
WORKER = "zero_worker"  # a module of the bench package, run as each rank
MiB = 1 << 20


def params(width: int) -> int:
    return LAYERS * (width * width + width)


def bucket(psi: int) -> int:
    """reduce_bucket_size: BUCKET, or psi // 2 for smaller models, so there are always several buckets."""
    return min(BUCKET, psi // 2)


def prefetch(psi: int) -> int:
    """stage3_prefetch_bucket_size: PREFETCH, scaled down with the model (two layers ahead at any width)."""
    return min(PREFETCH, psi // 2)


def persist(width: int) -> int:
    """stage3_param_persistence_threshold: PERSIST, below a weight's size at any width (weights partitioned,
    biases whole)."""
    return min(PERSIST, width * width // 2)


def formula_bytes(stage: int, psi: int, n: int = WORLD) -> float:
    """Model-state bytes per rank from the ZeRO paper, for fp32 training with
    Adam: params 4, grads 4, exp_avg + exp_avg_sq 8 bytes per param."""
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def offload_device_formula(stage: int, psi: int, n: int = WORLD) -> float:
    """ZeRO-Offload, fp32: what stays on the device (params 4 psi, or 4 psi/N
    at stage 3, and the grad shard 4 psi/N); the CPU holds the master and Adam
    state (12 psi/N) and its staging buffer for the incoming grads."""
    return (4 * psi if stage < 3 else 4 * psi / n) + 4 * psi / n


def run_job(spec: dict, timeout: float) -> dict:
    """Runs one variant as WORLD ranks; returns rank 0's result."""
    return run_ranks(WORKER, spec, WORLD, timeout)


@dataclass
class Jobs:
    """One ZeRO family's jobs: its variants (provider -> {row name: the
    worker's variant}), what each fastzero row is compared with (the fastest
    of `against[row]`, metric `best_metric`), the gated row, and its table's
    columns (header, metric, format, scale). ``family`` is what bench.run
    knows of it."""

    name: str
    description: str
    variants: dict[str, dict[str, dict]]
    against: dict[str, tuple[str, ...]]
    best_metric: str
    best_label: str
    gated: str
    columns: list[tuple[str, str, str, float]]
    legend: str
    roofline: bool = False  # the worker times the CPU Adam kernel against the streaming roofline

    @property
    def family(self) -> Family:
        # not in --all: minutes of 2-process jobs that fill both cores (the description says so)
        peers = tuple(p for p in self.variants if p != "fastzero")
        return Family(
            self.name, self.description, self.cases, peers, None, in_all=False, measure=self.measure, table=self.table
        )

    def variant(self, row: str) -> dict:
        return next(v[row] for v in self.variants.values() if row in v)

    def cases(self, sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
        """One case per hidden width (``--sizes`` are widths here; fp32 only)."""
        out = []
        timed_here = self_timed(
            "a multi-process job: timed by python -m bench.run --kernel zero/zero3/offload, not per call"
        )
        for w in sizes or [QUICK_WIDTH if quick else WIDTH]:
            psi = params(w)
            provs = [Provider(p, "ours" if p == "fastzero" else "peer", timed_here) for p in self.variants]
            desc = (
                f"{LAYERS} x (Linear({w},{w}) + GELU), {psi / 1e6:.2f}M params fp32, micro-batch {MICRO} x "
                f"{WORLD} ranks (Gloo), AdamW, reduce bucket {bucket(psi):,} elements"
            )
            if self.name != "zero":
                desc += f"; stage 3: prefetch {prefetch(psi):,} elements, persistence threshold {persist(w):,}"
            out.append(Case(self.name, f"mlp{LAYERS}x{w}", psi, 0, provs, desc))
        return out

    def measure(self, case: Case, settings: Settings, say) -> tuple[list[dict], dict]:
        """Runs every variant of the case's providers (those not skipped), returns (rows, skipped)."""
        width = int(case.name.rsplit("x", 1)[1])
        spec = dict(
            width=width,
            layers=LAYERS,
            micro=MICRO,
            bucket=bucket(case.numel),
            persist=persist(width),
            warmup=settings.warmup,
            steps=STEPS_PER_REPEAT * settings.repeats,
            slowdown=settings.slowdown,
            roofline=self.roofline,
            kernel_rounds=15 if self.roofline else 7,
        )
        results, skipped = {}, {}
        for prov in case.providers:
            for name, variant in self.variants[prov.name].items():
                if name in settings.skip:  # a single variant, e.g. --skip fsdp2-reshard
                    continue
                if variant.get("prefetch"):
                    variant = dict(variant, prefetch=prefetch(case.numel))
                say(f"{case.name}: {name} ({WORLD} processes)")
                try:
                    job = dict(spec, provider=prov.name, variant=variant)
                    res = run_job(job, timeout=120 if settings.quick else 600)
                except JobFailed as exc:
                    if prov.kind == "ours":
                        raise
                    skipped[name] = f"failed: {exc}"  # a peer's failure is reported, not ours to fail on
                    continue
                if "skipped" in res:
                    skipped[name] = res["skipped"]
                else:
                    results[name] = res
        return self.rows(case, results), skipped

    def rows(self, case: Case, results: dict[str, dict]) -> list[dict]:
        out = Rows(case)
        psi = case.numel
        medians = {}
        for name, res in results.items():
            t = Timing(name, "ours" if name.startswith("fastzero") else "peer", res["times"])
            medians[name] = t.median
            out.add(name, "median_ms", t.median * 1e3)
            out.add(name, "spread", t.spread)
            out.add(name, "samples_per_s", MICRO * WORLD / t.median)
            out.add(name, "timed_steps", len(res["times"]))
            out.add(name, "model_state_bytes", res["model_state_bytes"])
            if self.name != "zero":
                out.add(name, "peak_rss_growth_bytes", res.get("peak_rss_growth_bytes"))
            if name.startswith("fastzero"):
                self._fastzero_rows(out, name, res, psi)
        for name in [n for n in medians if n.startswith("fastzero")]:
            for peer in [n for n in medians if not n.startswith("fastzero")]:
                out.add(name, f"speedup_vs_{peer}", medians[peer] / medians[name])
            best = min((medians[n] for n in self.against.get(name, ()) if n in medians), default=None)
            if best is not None:
                # the gated figure: one ratio of the same run, against whichever named peer was fastest
                out.add(name, self.best_metric, best / medians[name], gated=name == self.gated)
        return out

    def _fastzero_rows(self, out: Rows, name, res, psi) -> None:
        v, ex = self.variant(name), res["extra"]
        stage, offload = v["stage"], v.get("offload", False)
        buckets, persistent = res["grad_bucket_bytes"], res.get("persistent_bytes", 0)
        out.add(name, "grad_bucket_bytes", buckets)
        out.add(name, "grad_comm_hidden", ex["hidden_frac"])
        out.add(name, "step_call_ms", ex["step_ms"])
        out.add(name, "kernel_ms", ex["kernel_ms"])
        if stage == 3:
            out.add(name, "persistent_bytes", persistent)
            out.add(name, "peak_gathered_bytes", res["peak_gathered_bytes"])
        if offload:
            device = res["model_state_bytes"] - res["offloaded_bytes"]
            formula = offload_device_formula(stage, psi)
            out.add(name, "device_bytes", device)
            out.add(name, "offloaded_bytes", res["offloaded_bytes"])
            out.add(name, "staging_bytes", res["staging_bytes"])
            out.add(name, "device_formula_bytes", formula)
            out.add(name, "of_device_formula", (device - buckets - persistent) / formula)
            out.add(name, "adam_in_step_ms", ex["adam_in_step_ms"])
            for key in ("roofline_ms", "kernel_gbps", "roofline_gbps", "kernel_of_roofline"):
                out.add(name, key, ex[key])
            return
        formula = formula_bytes(stage, psi)
        out.add(name, "zero_formula_bytes", formula)
        out.add(name, "of_zero_formula", (res["model_state_bytes"] - buckets - persistent) / formula)
        if stage < 3:
            out.add(name, "allgather_ms", ex["allgather_ms"])
            out.add(name, "param_wait_ms", ex.get("param_wait_ms"))
            out.add(name, "step_over_kernel_allgather", ex["step_ms"] / (ex["kernel_ms"] + ex["allgather_ms"]))

    def table(self, case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
        """Markdown for bench.run's terminal output and report."""
        cols = self.columns
        lines = [row(["provider", *(c[0] for c in cols)]), "|---|" + "---:|" * len(cols)]
        for prov, m in provs.items():
            lines.append(row([prov, *(fmt(m.get(key), spec, scale) for _, key, spec, scale in cols)]))
        lines += skipped_lines(case_info, len(cols) + 1)
        ours = [p for p in provs if p.startswith("fastzero")]
        peers = [p for p in provs if not p.startswith("fastzero")]
        if ours and peers:
            lines += [
                "",
                "Speedup of fastzero (peer time / fastzero time, same run):",
                "",
                "| " + row([*peers, self.best_label]),
            ]
            lines.append("|---|" + "---:|" * (len(peers) + 1))
            for p in ours:
                cells = [fmt(provs[p].get(f"speedup_vs_{q}"), ".2f") + "x" for q in peers]
                best = provs[p].get(self.best_metric)
                lines.append(row([p, *cells, f"{fmt(best, '.2f')}{'x' if best else ''}"]))
        return lines + ["", self.legend]


# the tables' columns, by metric: (header, metric, format, scale)
COLUMNS = {
    c[1]: c
    for c in [
        ("ms/step", "median_ms", ".1f", 1.0),
        ("spread", "spread", ".1%", 1.0),
        ("samples/s", "samples_per_s", ".0f", 1.0),
        ("model states MiB/rank", "model_state_bytes", ".1f", MiB),
        ("ZeRO formula MiB", "zero_formula_bytes", ".1f", MiB),
        ("of formula", "of_zero_formula", ".2f", 1.0),
        ("bucket buffers MiB", "grad_bucket_bytes", ".1f", MiB),
        ("grad comm hidden", "grad_comm_hidden", ".0%", 1.0),
        ("step() ms", "step_call_ms", ".1f", 1.0),
        ("kernel ms", "kernel_ms", ".1f", 1.0),
        ("all-gather ms", "allgather_ms", ".1f", 1.0),
        ("forward waits ms", "param_wait_ms", ".1f", 1.0),
        ("step / (kernel + AG)", "step_over_kernel_allgather", ".2f", 1.0),
        ("persistent MiB", "persistent_bytes", ".2f", MiB),
        ("peak gathered params MiB", "peak_gathered_bytes", ".1f", MiB),
        ("peak RSS growth MiB", "peak_rss_growth_bytes", ".1f", MiB),
        ("on device MiB", "device_bytes", ".1f", MiB),
        ("device formula MiB", "device_formula_bytes", ".1f", MiB),
        ("of formula", "of_device_formula", ".2f", 1.0),
        ("offloaded MiB", "offloaded_bytes", ".1f", MiB),
        ("of it staging MiB", "staging_bytes", ".1f", MiB),
        ("Adam in step() ms", "adam_in_step_ms", ".1f", 1.0),
        ("kernel GB/s", "kernel_gbps", ".1f", 1.0),
        ("roofline GB/s", "roofline_gbps", ".1f", 1.0),
        ("kernel of roofline", "kernel_of_roofline", ".2f", 1.0),
    ]
}


def _columns(metrics: str, **own: tuple[str, str, float]) -> list[tuple[str, str, str, float]]:
    """Time, spread and samples/s, then the columns of `metrics` (names apart by spaces): COLUMNS', or a family's
    own (header, format, scale) for a metric."""
    names = ["median_ms", "spread", "samples_per_s", *metrics.split()]
    return [(own[m][0], m, *own[m][1:]) if m in own else COLUMNS[m] for m in names]


_TIMES = (
    f"ms/step: median of rank 0's timed steps (forward + backward + step); spread: IQR / median; samples/s: "
    f"{MICRO * WORLD} / step time. "
)
_STATES = (
    "Model states: bytes held per rank between steps{where} (fastzero: the sum of memory_breakdown(); peers: the "
    "distinct storages of their params, grads and optimizer state{how}). "
)
_RSS = (
    "Peak RSS growth: the process's peak resident set over the timed steps (VmHWM, reset after warm-up) less its RSS "
    "before the model was made (torch's one-time set-up paid before): everything the training holds at its peak, "
    "gathered params and activations included, and what glibc's malloc keeps of what was freed: once its mmap "
    "threshold has risen, freed MiB-sized blocks stay in its heap, so this grows with the steps taken and is "
    "mostly the allocator's (MALLOC_MMAP_THRESHOLD_=131072 removes that part). "
)
_KERNEL = "kernel: the fastzero CPU Adam kernel alone over fresh fp32 tensors of the rank's shard size. "
TORCH = ("ddp", "fsdp2", "fsdp2-reshard")
ZEROPP = {"zero_quantized_weights": True, "zero_quantized_gradients": True}

ZERO_JOBS = Jobs(
    name="zero",
    description=(
        "ZeRO stages 0-2 training step (2 ranks, Gloo) vs DDP, FSDP2, DeepSpeed; not in --all: 30-45 s of "
        "2-process jobs that fill both cores, and its gated ratio moved up to 14% between quiet quick runs (CI "
        "allows 12%)"
    ),
    variants={
        "fastzero": {
            "fastzero-s0": {"stage": 0},
            "fastzero-s1": {"stage": 1},
            "fastzero-s2": {"stage": 2},
            # ZeRO++'s int8 post-step all-gather and int4 gradient exchange (docs/zeropp.md)
            "fastzero-s1-zeropp": {"stage": 1, "zero": ZEROPP},
            "fastzero-s2-zeropp": {"stage": 2, "zero": ZEROPP},
        },
        "ddp": {"ddp": {}},
        "fsdp2": {"fsdp2": {"reshard": False}, "fsdp2-reshard": {"reshard": True}},
        "deepspeed": {"deepspeed-s1": {"stage": 1}, "deepspeed-s2": {"stage": 2}},
    },
    against={
        n: TORCH for n in ("fastzero-s0", "fastzero-s1", "fastzero-s2", "fastzero-s1-zeropp", "fastzero-s2-zeropp")
    },
    best_metric="speedup_vs_fastest_torch",
    best_label="fastest torch",
    gated="fastzero-s2",
    columns=_columns(
        "model_state_bytes zero_formula_bytes of_zero_formula grad_bucket_bytes grad_comm_hidden step_call_ms "
        "kernel_ms allgather_ms param_wait_ms step_over_kernel_allgather",
    ),
    legend=_TIMES
    + _STATES.format(where="", how=", DTensor local shards, DeepSpeed's flat buffers")
    + (
        "ZeRO formula (fp32 Adam, N ranks): 16 psi, 8 psi + 8 psi/N, 4 psi + 12 psi/N; 'of formula' "
        "leaves the bucket buffers out. Grad comm hidden: the share of the gradient collectives' time (launch to "
        "done) before backward ended. step(): engine.step(); kernel: the Adam kernel alone over the rank's shard; "
        "all-gather: the span of the params' all-gathers, which step() leaves in flight (overlap_comm); forward "
        "waits: the time the next forward's pre-hooks blocked on them, summed over buckets (CommEvent.waited)."
    ),
)

ZERO3_JOBS = Jobs(
    name="zero3",
    description=(
        "ZeRO stage 3 training step (2 ranks, Gloo), prefetch on and off, vs FSDP2 full sharding and DeepSpeed "
        "stage 3; not in --all (2-process jobs that fill both cores)"
    ),
    variants={
        "fastzero": {
            "fastzero-s3": {"stage": 3, "prefetch": PREFETCH},
            "fastzero-s3-noprefetch": {"stage": 3, "prefetch": 0},
        },
        "fsdp2": {"fsdp2-reshard": {"reshard": True}},
        "deepspeed": {"deepspeed-s3": {"stage": 3, "prefetch": PREFETCH}},
    },
    against={n: ("fsdp2-reshard", "deepspeed-s3") for n in ("fastzero-s3", "fastzero-s3-noprefetch")},
    best_metric="speedup_vs_fastest_peer",
    best_label="faster of FSDP2, DeepSpeed s3",
    gated="fastzero-s3",
    columns=_columns(
        "model_state_bytes zero_formula_bytes persistent_bytes grad_bucket_bytes of_zero_formula "
        "peak_gathered_bytes peak_rss_growth_bytes grad_comm_hidden step_call_ms kernel_ms",
        zero_formula_bytes=("ZeRO-3 formula 16psi/N MiB", ".1f", MiB),
    ),
    legend=_TIMES
    + _STATES.format(where="", how=": DTensor local shards, DeepSpeed's partitions")
    + (
        "ZeRO-3 formula (fp32 Adam, N ranks): 16 psi / N; 'of formula' leaves out the persistent "
        "params (held whole on every rank) and the gradient bucket buffers. Peak gathered params: the stage-3 "
        "runtime's own peak of gathered (or in-flight) partitioned params, engine.fetcher.peak_live elements at "
        "the param dtype (with the default stage3_max_reuse_distance, params gathered in forward stay for backward: "
        "the whole model at the peak). "
        + _RSS
        + "Grad comm hidden: the share of the reduce-scatters' time (launch to done) before backward ended. step(): "
        "engine.step(); " + _KERNEL
    ),
)

OFFLOAD_JOBS = Jobs(
    name="offload",
    description=(
        "ZeRO-Offload (optimizer on the CPU) at stages 2 and 3 (2 ranks, Gloo) vs FSDP2 CPU offload and DeepSpeed "
        "offload_optimizer; CPU Adam vs the streaming roofline; not in --all (2-process jobs that fill both cores)"
    ),
    variants={
        "fastzero": {
            "fastzero-s2-offload": {"stage": 2, "offload": True},
            "fastzero-s3-offload": {"stage": 3, "prefetch": PREFETCH, "offload": True},
            # the CPU states in fewer bytes (docs/optimizers.md, "State formats")
            "fastzero-s2-offload-bf16": {"stage": 2, "offload": True, "optimizer": {"state_format": "bf16"}},
            "fastzero-s2-offload-int8": {"stage": 2, "offload": True, "optimizer": {"state_format": "int8"}},
        },
        "fsdp2": {"fsdp2-offload": {"reshard": True, "offload": True}},
        "deepspeed": {
            "deepspeed-s2-offload": {"stage": 2, "offload": True},
            "deepspeed-s3-offload": {"stage": 3, "prefetch": PREFETCH, "offload": True},
        },
    },
    against={
        "fastzero-s2-offload": ("fsdp2-offload", "deepspeed-s2-offload"),
        "fastzero-s3-offload": ("fsdp2-offload", "deepspeed-s3-offload"),
        "fastzero-s2-offload-bf16": ("fsdp2-offload", "deepspeed-s2-offload"),
        "fastzero-s2-offload-int8": ("fsdp2-offload", "deepspeed-s2-offload"),
    },
    best_metric="speedup_vs_fastest_peer",
    best_label="faster of FSDP2 offload, DeepSpeed offload (same stage)",
    gated="fastzero-s2-offload",
    roofline=True,
    columns=_columns(
        "model_state_bytes device_bytes device_formula_bytes of_device_formula offloaded_bytes staging_bytes "
        "peak_rss_growth_bytes step_call_ms adam_in_step_ms kernel_ms kernel_gbps roofline_gbps kernel_of_roofline",
        kernel_ms=("kernel ms", ".2f", 1.0),
    ),
    legend=_TIMES
    + _STATES.format(where=", device and CPU together", how=", all in CPU memory here")
    + (
        "fastzero splits them: on device (params, grad shard, bucket buffers) and offloaded "
        "(offload_master, offload_optimizer and offload_staging, the CPU buffer the grads come into). Device "
        "formula (fp32, N ranks): 4 psi + 4 psi/N at stage 2, 8 psi/N at stage 3 (grads and params sharded); "
        "'of formula' leaves out the bucket buffers and stage 3's persistent params. " + _RSS + "step(): "
        "engine.step(); Adam in step(): the cpu_adam_step calls inside it; " + _KERNEL + "Roofline: the "
        "streaming probe of bench --kernel cpu_adam (28 bytes per param, in place), timed in interleaved rounds "
        "with the kernel in the same process; kernel of roofline = roofline time / kernel time, round by round."
    ),
)

ZERO, ZERO3, OFFLOAD = ZERO_JOBS.family, ZERO3_JOBS.family, OFFLOAD_JOBS.family
