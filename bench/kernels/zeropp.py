"""ZeRO++ (qwZ, qgZ, hpZ) end to end, and its kernels: ``python -m bench.run --kernel zeropp``.

The kernels' throughput against the memory roofline are the ``quant``
family's cases (``--kernel quant`` runs them alone; their rows carry the
kernel name ``quant``). The end-to-end case: 4 Gloo processes as 2
simulated nodes of 2 (bench/zeropp_worker.py), ZeRO stage 3 training the
GPT-like model of bench/tiny_gpt.py (hidden 256, 4 layers; ``--quick``:
hidden 64, 2 layers), one job per variant, one after another:

* ``fastzero-base``: unquantized stage 3; ``fastzero-qwz``,
  ``fastzero-qgz``, ``fastzero-hpz``: each part alone; ``fastzero-all``:
  all three (``zero_quantized_weights``, ``zero_quantized_gradients`` with
  int4, ``zero_hpz_partition_size: 2``: the node);
* ``deepspeed-*``: the same five on DeepSpeed's stage 3 with the same keys,
  where ``import deepspeed`` works (bench/zeropp_deepspeed.py); a variant
  that fails is reported with its reason.

Reported per variant: ms/step (median of rank 0's timed steps) and spread;
for one counted step, the bytes this rank sent (the bandwidth-optimal
algorithm's ``wire_bytes``) and the bytes it received from the other node
(the direct algorithm: ``cross_node_bytes``), split into param gathers, the
gradient exchange and the rest; each as a fraction of the same provider's
baseline (the target: all three cut the bytes across nodes >= 3.5x, the
slow links' traffic ZeRO++ is for); a network model, cross-node bytes over
a 10 and a 100 Gb/s link (no latency, no compute: what the bytes alone
cost on such links); the model-state bytes per rank (hpZ's pieces
included). Not gated, not in --all: 4 processes on 2 cores for minutes,
and the bytes are exact anyway.
"""

from __future__ import annotations

from ..family import Family, Settings
from ..harness import Case, Provider, Rows, Timing, self_timed
from ..jobs import JobFailed, run_ranks
from ..tables import fmt, row, skipped_lines
from . import quant

WORLD, NODE = 4, 2
MiB = 1 << 20
LINKS = {"10gbps": 10e9 / 8, "100gbps": 100e9 / 8}  # bytes per second
PARTS = {
    "base": {},
    "qwz": {"zero_quantized_weights": True},
    "qgz": {"zero_quantized_gradients": True},
    "hpz": {"zero_hpz_partition_size": NODE},
    "all": {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": NODE},
}
PROVIDERS = (("fastzero", "ours"), ("deepspeed", "peer"))
KINDS = ("param", "grad", "other")
TARGET = 3.5  # all three: at least this many times fewer bytes across nodes than the baseline


def shape(quick: bool) -> dict:
    return dict(hidden=64, layers=2, steps=4, warmup=2) if quick else dict(hidden=256, layers=4, steps=10, warmup=3)


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    timed = self_timed("a multi-process job: timed by python -m bench.run --kernel zeropp")
    kernels = quant.QUANT.cases(None, dtypes, quick, device)
    if device != "cpu":
        return kernels
    out = []
    for hidden in sizes or [shape(quick)["hidden"]]:
        s = dict(shape(quick), hidden=hidden)
        psi = hidden * hidden * 12 * s["layers"] + hidden * (64 + 16 + 64)
        desc = (
            f"ZeRO stage 3, the GPT-like model of bench/tiny_gpt.py (hidden {hidden}, {s['layers']} layers, "
            f"~{psi / 1e6:.2f}M params, fp32), {WORLD} Gloo processes as {WORLD // NODE} simulated nodes of {NODE}, "
            "micro-batch 4 x 16 tokens per rank, AdamW"
        )
        provs = [Provider(p, k, timed) for p, k in PROVIDERS]
        out.append(Case(FAMILY.name, f"gpt-h{hidden}", psi, 0, provs, desc))
    return kernels + out


def measure(case: Case, settings: Settings, say) -> tuple[list[dict], dict[str, str]]:
    if case.kernel == quant.QUANT.name:
        return quant.QUANT.measure(case, settings, say)
    hidden = int(case.name.rsplit("h", 1)[1])
    s = dict(shape(settings.quick), hidden=hidden)
    spec = dict(
        s, micro=4, bucket=max(10_000, hidden * hidden * 4), persist=hidden * 8, steps=max(s["steps"], settings.repeats)
    )
    if settings.quick:
        spec["steps"] = s["steps"]
    results, skipped = {}, {}
    for prov in case.providers:
        for part, variant in PARTS.items():
            name = f"{prov.name}-{part}"
            if name in settings.skip or prov.name in settings.skip:
                continue
            say(f"{case.name}: {name} ({WORLD} processes)")
            try:
                res = run_ranks(
                    "zeropp_worker",
                    dict(spec, provider=prov.name, variant=variant),
                    WORLD,
                    timeout=300 if settings.quick else 1200,
                    local_world=NODE,
                )
            except JobFailed as exc:
                if prov.kind == "ours":
                    raise
                skipped[name] = f"failed: {exc}"
                continue
            if "skipped" in res:
                skipped[name] = res["skipped"]
            else:
                results[name] = res
    return rows(case, results), skipped


def rows(case: Case, results: dict[str, dict]) -> list[dict]:
    out = Rows(case, gated=False)
    for name, res in results.items():
        t = Timing(name, "ours" if name.startswith("fastzero") else "peer", res["times"])
        out.add(name, "median_ms", t.median * 1e3)
        out.add(name, "spread", t.spread)
        out.add(name, "model_state_bytes", res.get("model_state_bytes"))
        out.add(name, "collectives", res.get("collectives"))
        for side in ("wire", "cross"):
            total = sum(res.get(f"{side}_{k}", 0.0) for k in KINDS)
            out.add(name, f"{side}_bytes", total)
            for k in KINDS:
                out.add(name, f"{side}_{k}_bytes", res.get(f"{side}_{k}", 0.0))
        cross = sum(res.get(f"cross_{k}", 0.0) for k in KINDS)
        for link, rate in LINKS.items():
            out.add(name, f"model_ms_{link}", cross / rate * 1e3)
        base = results.get(name.rsplit("-", 1)[0] + "-base")
        if base is not None and base is not res:
            for side in ("wire", "cross"):
                mine = sum(res.get(f"{side}_{k}", 0.0) for k in KINDS)
                theirs = sum(base.get(f"{side}_{k}", 0.0) for k in KINDS)
                out.add(name, f"{side}_bytes_vs_base", theirs / mine if mine else None)
            out.add(name, "speedup_vs_base", Timing(name, "", base["times"]).median / t.median)
    return out


def table(case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
    if case_info.get("kernel") == quant.QUANT.name:
        return quant.QUANT.table(case_info, provs)
    head = [
        "variant",
        "ms/step",
        "spread",
        "sent MiB (params / grads / rest)",
        "fewer sent",
        "from the other node MiB",
        "fewer across nodes",
        "10 Gb/s ms",
        "100 Gb/s ms",
        "states MiB/rank",
    ]
    lines = [row(head), "|---|" + "---:|" * (len(head) - 1)]
    mib = lambda v: fmt(v, ".3f", MiB)
    for prov, m in provs.items():
        split = " / ".join(mib(m.get(f"wire_{k}_bytes")) for k in KINDS)
        lines.append(
            row(
                [
                    prov,
                    fmt(m.get("median_ms"), ".1f"),
                    fmt(m.get("spread"), ".0%"),
                    f"{mib(m.get('wire_bytes'))} ({split})",
                    fmt(m.get("wire_bytes_vs_base"), ".2f") + ("x" if m.get("wire_bytes_vs_base") else ""),
                    mib(m.get("cross_bytes")),
                    fmt(m.get("cross_bytes_vs_base"), ".2f") + ("x" if m.get("cross_bytes_vs_base") else ""),
                    fmt(m.get("model_ms_10gbps"), ".2f"),
                    fmt(m.get("model_ms_100gbps"), ".3f"),
                    fmt(m.get("model_state_bytes"), ".2f", MiB),
                ]
            )
        )
    lines += skipped_lines(case_info, len(head))
    legend = (
        "One counted step after the timed ones. Sent: bytes this rank sent (CommEvent.wire_bytes: the "
        "bandwidth-optimal algorithm), params = the stage-3 param gathers, grads = the gradient reduce-scatter "
        "(qgZ: its all-to-alls), rest = norms, agreement, the persistent params. From the other node: bytes this "
        f"rank received from ranks of the other simulated node (direct algorithm). Fewer: the provider's baseline "
        f"over the variant (target for -all across nodes: >= {TARGET}x). 10/100 Gb/s ms: the cross-node bytes over "
        "such a link, no latency or compute. ms/step: loopback on one machine, 4 processes on its cores."
    )
    return lines + ["", legend]


FAMILY = Family(
    name="zeropp",
    description=(
        "ZeRO++ (qwZ, qgZ, hpZ) at stage 3 on 4 Gloo processes as 2 nodes vs unquantized and DeepSpeed's ZeRO++: "
        "bytes per step sent and across nodes, ms/step, a 10/100 Gb/s model; and the quant kernels vs their "
        "roofline; not in --all (minutes of 4-process jobs)"
    ),
    cases=cases,
    peers=("deepspeed",),
    roofline=None,  # its own case has none; the quant cases are the quant family's, with its roofline
    in_all=False,
    measure=measure,
    table=table,
)
