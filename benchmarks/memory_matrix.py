"""The memory model against the compiled step over a generated matrix of shapes, per backend.

Each case compiles amsp_jax's real train step (nothing runs) and compares XLA's own peak per device
(`compiled.memory_analysis()`: arguments + outputs − donated aliases + temporaries) with
`cost.memory`'s prediction. The matrix spans sequence 128 to 8,192, micro-batches 1-4, one or two
sequences per micro-batch, remat none/dots/full, fp32 and mixed precision, and widths from the shipped
`tiny` to LLaMA-7B's (few layers at the large widths: the memory per layer is what the model prices),
compiled for the CPU mesh (2 nodes × 4 simulated devices) and, with `--target`, by XLA's CUDA compiler
for 2 nodes × 8 GPUs (no GPU needed).

    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.memory_matrix                     # CPU-compiled
    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.memory_matrix --target h100-sxm   # GPU-compiled
    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.memory_matrix --tensor [--target h100-sxm]
    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.memory_matrix --users --target h100-sxm

`--tensor` runs the tensor-parallel matrix instead (`tensor_matrix`: t = 2 and 4, sequence parallelism
on and off, beside the same shapes without a tensor axis); `--users` the shipped 1B-class models at
their full depth (`users_matrix`).

writes a dated benchmarks/results/memory_matrix_<backend>_<date>.md (and .json) with every case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from amsp_jax.core.backend import cpu_flags  # imports no JAX

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--target" not in " ".join(sys.argv):
    # The CPU mesh: 8 simulated devices, set before JAX starts.
    os.environ["XLA_FLAGS"] = cpu_flags(os.environ.get("XLA_FLAGS", ""), 8)
# LLVM's lowest level, as the tests compile: buffer assignment (the compiled memory) is the same.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax
import jax.numpy as jnp
import jaxlib
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from amsp_jax import cost
from amsp_jax.compiled import audit, gpu_target
from amsp_jax.core import backend as xla_backend
from amsp_jax.core.plan import Plan
from amsp_jax.core.space import Cluster, resolve
from amsp_jax.models.llama import Llama, LlamaConfig, make_loss_fn
from amsp_jax.trainer import Trainer
from benchmarks import results_file

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "configs" / "models"

# Widths beyond the shipped small models, each at few layers (a layer's memory is what is priced).
WIDTHS: dict[str, LlamaConfig] = {
    "w1024": LlamaConfig(vocab_size=4096, dim=1024, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=2816),
    "1b-width": dataclasses.replace(LlamaConfig.from_yaml(MODELS / "llama-1b.yaml"), n_layers=4),
    "7b-width": dataclasses.replace(LlamaConfig.from_yaml(MODELS / "llama-7b.yaml"), n_layers=4),
    # Four key/value heads, so that t = 4 splits them; small enough to compile on the CPU mesh.
    "w256": LlamaConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=688),
}


def config_of(name: str) -> LlamaConfig:
    """A shipped model (`tiny`, `small`) or one of `WIDTHS`."""
    return WIDTHS[name] if name in WIDTHS else LlamaConfig.from_yaml(MODELS / f"{name}.yaml")


@dataclasses.dataclass(frozen=True)
class Case:
    """One compiled step: model, tokens per sequence, sequences per micro-batch, micro-batches, plan."""

    model: str
    seq: int
    batch: int
    micro_batches: int
    remat: str
    precision: str
    strategy: str
    sequence_parallel: bool = True  # read only where the strategy has a tensor axis (`t=...`)
    matmul: str = "gather"  # the tensor matmul form (`Plan.tensor_matmul`)

    @property
    def name(self) -> str:
        off = "-nosp" if not self.sequence_parallel and self.strategy.startswith("t=") else ""
        form = f"-{self.matmul}" if self.matmul != "gather" else ""
        return (
            f"{self.model}-s{self.seq}-b{self.batch}-m{self.micro_batches}-{self.remat}-{self.precision}-"
            f"{self.strategy}{off}{form}"
        )


def _trainer(
    case: Case, devices: list[jax.Device] | None, cluster: Cluster
) -> tuple[Trainer, Any, LlamaConfig]:
    config = dataclasses.replace(config_of(case.model), max_seq_len=max(case.seq, 1))
    # OS over whole nodes: `os=4x2` names the CPU mesh's node of 4; on 8 GPUs a node is 8.
    strategy = case.strategy.replace("os=4x2", f"os={cluster.devices_per_node}x2")
    plan = Plan(
        cluster, resolve(strategy, cluster), case.micro_batches, precision=case.precision,
        remat=case.remat, sequence_parallel=case.sequence_parallel, tensor_matmul=case.matmul,
    )  # fmt: skip
    model = Llama(config)
    trainer = Trainer(plan, model, optax.adamw(1e-4), make_loss_fn(model), devices=devices)
    trainer.setup(jax.random.key(0), jnp.zeros((1, case.seq), jnp.int32))
    # The ranks of a tensor group share their sequences.
    sequences = cluster.num_devices // plan.strategy.tensor * case.micro_batches * case.batch
    tokens = jax.ShapeDtypeStruct((sequences, case.seq), jnp.int32)
    return trainer, {"inputs": tokens, "targets": tokens}, config


def compile_case(case: Case, devices: list[jax.Device] | None, cluster: Cluster) -> audit.Report:
    """The audit of `case`'s step on `devices` (None: JAX's own, the CPU mesh)."""
    trainer, batch, config = _trainer(case, devices, cluster)
    return audit.audit_trainer(trainer, batch, cost.llama_dims(config))


def predict_case(case: Case, devices: list[jax.Device] | None, cluster: Cluster) -> cost.Memory:
    """`case`'s predicted memory, without compiling (the compiled side does not change with the model)."""
    trainer, batch, config = _trainer(case, devices, cluster)
    workload = audit.workload_of(trainer, batch, cost.llama_dims(config))
    return cost.predict(trainer.program.layout, workload).memory


# Every (precision, remat) pair, taken two at a time per (width, sequence) so that each width sees all six.
PAIRS = [(p, r) for p in ("fp32", "mixed") for r in ("none", "dots", "full")]
WIDTH_ORDER = ["tiny", "small", "w1024", "1b-width", "7b-width"]
STRATEGIES = ["zero3", "zero1", "zero2", "mics", "p=4x1,g=4x1,os=4x2"]


def matrix() -> list[Case]:
    """The generated matrix: the README's command and its neighbours on `tiny` at 256 tokens; per width,
    sequences 128 to 8,192 with the six (precision, remat) pairs in turn; micro-batches 1-4 with one or
    two sequences each; and the placements, in turn per width."""
    cases = [Case("tiny", 256, 1, 2, "full", "fp32", s) for s in STRATEGIES]
    cases += [Case("tiny", 256, 1, 1, r, p, "zero3") for p, r in PAIRS]
    for w, model in enumerate(WIDTH_ORDER):
        for i, seq in enumerate((128, 512, 2048, 8192)):
            for k in (0, 3):
                precision, remat = PAIRS[(w + i + k) % len(PAIRS)]
                cases.append(Case(model, seq, 1, 1, remat, precision, "zero3"))
        cases.append(Case(model, 1024, 1, 4, "full", "mixed", STRATEGIES[w % 5]))
        cases.append(Case(model, 1024, 2, 2, "dots", "fp32", STRATEGIES[(w + 3) % 5]))
        cases.append(Case(model, 512, 2, 3, "none", "mixed", STRATEGIES[(w + 1) % 5]))
        cases.append(Case(model, 2048, 1, 2, "full", "mixed", STRATEGIES[(w + 2) % 5]))
    seen: set[Case] = set()
    return [c for c in cases if not (c in seen or seen.add(c))]


def tensor_matrix(gpu: bool) -> list[Case]:
    """Tensor-parallel steps: t = 2 and 4, sequence parallelism on and off, each remat policy and
    precision, the placement kinds and micro-batches; on the CPU mesh `w256` at 1,024-2,048 tokens, for
    GPUs the widths of LLaMA-1B and 7B at 2,048 and 8,192, there also the ring and cannon matmul forms."""
    cases: list[Case] = []
    if not gpu:
        for i, (t, seq) in enumerate((t, s) for t in (2, 4) for s in (1024, 2048)):
            for k, (precision, remat) in enumerate(PAIRS):
                mixed = "p=1x1,g=2x1,os=2x2" if t == 2 else "p=1x2,g=1x2,os=1x2"
                strategy = ("zero3", "mics", mixed)[(i + k) % 3]
                sp = (i + k) % 2 == 0
                cases.append(Case("w256", seq, 1, 1 + 2 * (k % 2), remat, precision, f"t={t},{strategy}", sp))
        # The same shapes without a tensor axis, for reference.
        refs = [(s, 1 + 2 * (k % 2), p, r) for s in (1024, 2048) for k, (p, r) in enumerate(PAIRS)]
        return cases + [Case("w256", s, 1, m, r, p, "zero3") for s, m, p, r in refs]
    for model in ("1b-width", "7b-width"):
        for seq in (2048, 8192):
            for t in (2, 4):
                for sp in (True, False):
                    cases.append(Case(model, seq, 1, 1, "full", "mixed", f"t={t},zero3", sp))
    cases += [
        Case("1b-width", 2048, 1, 1, r, "mixed", f"t={t},zero3", sp)
        for t, r, sp in ((2, "none", True), (4, "dots", False), (2, "dots", True), (4, "none", False))
    ]
    cases += [Case("1b-width", 2048, 1, 2, "full", "mixed", "t=2,mics", True)]
    # The fused matmul forms at t = 4 (the cannon form's square), beside the gather form's cases above.
    cases += [
        Case(model, seq, 1, 1, remat, "mixed", "t=4,zero3", True, form)
        for model, remats in (("1b-width", ("full", "none")), ("7b-width", ("full",)))
        for seq in (2048, 8192) for remat in remats for form in ("ring", "cannon")
    ]  # fmt: skip
    # The same shapes without a tensor axis, for reference.
    widths = ("1b-width", "7b-width")
    cases += [Case(m, s, 1, 1, "full", "mixed", "zero3") for m in widths for s in (2048, 8192)]
    return cases


def users_matrix() -> list[Case]:
    """Shipped models at their full depth, as GPU users train them: LLaMA-1B (vocabulary 32,000),
    Llama-3.2-1B's shape (`llama3-1b`, 128,256) and a 1.5B with 151,936, whose embedding and head are
    a large share of the step, at 1,024-8,192 tokens, one to four micro-batches, mixed precision (one
    fp32 case) and every placement kind."""
    rows = [
        ("llama3-1b", 2048, 1, "full", "mixed", "zero3"), ("llama3-1b", 2048, 2, "none", "mixed", "mics"),
        ("llama3-1b", 4096, 2, "full", "mixed", "zero1"), ("llama3-1b", 8192, 1, "dots", "mixed", "zero2"),
        ("llama3-1b", 4096, 4, "full", "mixed", "p=4x1,g=4x1,os=4x2"),
        ("llama-1b", 2048, 1, "dots", "mixed", "zero3"),
        ("llama-1b", 4096, 4, "full", "mixed", "p=4x1,g=4x1,os=4x2"),
        ("llama-1b", 8192, 1, "full", "mixed", "zero3"), ("llama-1b", 2048, 1, "none", "mixed", "zero2"),
        ("llama-1b", 1024, 2, "full", "fp32", "zero3"), ("llama-1b", 2048, 2, "full", "mixed", "zero1"),
        ("llama-1.5b", 4096, 1, "full", "mixed", "zero3"), ("llama-1.5b", 2048, 2, "full", "mixed", "mics"),
        ("llama-1.5b", 8192, 1, "dots", "mixed", "p=4x1,g=4x1,os=4x2"),
    ]  # fmt: skip
    return [Case(model, seq, 1, m, remat, precision, strategy) for model, seq, m, remat, precision, strategy
            in rows]  # fmt: skip


def row(case: Case, compiled: int, memory: cost.Memory, seconds: float | None) -> dict[str, Any]:
    return {
        **dataclasses.asdict(case),
        "compiled": compiled,
        "predicted": memory.total,
        "peak": memory.peak_name,
        "ratio": round(compiled / memory.total, 4),
        "predicted_breakdown": memory.as_dict(),
        "compile_s": seconds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--target", help="compile for this GPU (h100-sxm, a100-sxm-80); default: the CPU mesh"
    )
    parser.add_argument("--tensor", action="store_true", help="the tensor-parallel matrix (`tensor_matrix`)")
    parser.add_argument("--users", action="store_true", help="shipped 1B-class models (`users_matrix`)")
    parser.add_argument("--only", default="", help="only cases whose name contains each comma-separated part")
    parser.add_argument("--max-seq", type=int, default=8192, help="skip cases with longer sequences")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--no-file", action="store_true", help="print only")
    parser.add_argument(
        "--compiled-with", help="read the compiled bytes another jaxlib version compiled (its cache files)"
    )
    parser.add_argument("--cached-only", action="store_true", help="only cases compiled already (re-predict)")
    parser.add_argument("--shard", default="", help="I/N: every N-th case from the I-th (parallel runs)")
    parser.add_argument(
        "--cache", default=str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "amsp-jax"),
        help="where each backend's compiled bytes per case are kept, so that a re-run only re-predicts",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.target:
        devices: list[jax.Device] | None = gpu_target.topology(args.target, 2, 8)
        cluster = Cluster.detect(devices)
    else:
        devices, cluster = None, Cluster(2, 4)
    with xla_backend.predicting_for(args.compiled_with):  # predict what that version's XLA holds
        _run(args, devices, cluster)


def _run(args: argparse.Namespace, devices: list[jax.Device] | None, cluster: Cluster) -> None:
    """Compile (or read from the cache) and predict every case `args` selects, and write the table."""
    parts = [p for p in args.only.split(",") if p]
    generated = users_matrix() if args.users else matrix()
    generated = tensor_matrix(bool(args.target)) if args.tensor else generated
    cases = [c for c in generated if c.seq <= args.max_seq and all(p in c.name for p in parts)]
    backend = (args.target or "cpu8") + ("-tensor" if args.tensor else "-users" if args.users else "")
    if args.shard:
        index, count = map(int, args.shard.split("/"))
        cases = cases[index::count]
    # Each shard keeps its own file; every file of the backend is read.
    cache_dir = Path(args.cache)
    stem = f"memory_matrix_{backend}_jaxlib{args.compiled_with or jaxlib.__version__}"
    cache_path = cache_dir / f"{stem}{'-' + args.shard.replace('/', 'of') if args.shard else ''}.json"
    cache: dict[str, int] = {}
    for path in sorted(cache_dir.glob(f"{stem}*.json")):
        cache.update(json.loads(path.read_text()))
    rows = []
    for case in cases:
        start, seconds = time.perf_counter(), None
        try:
            if args.cached_only and case.name not in cache:
                continue
            if case.name in cache:
                compiled, memory = cache[case.name], predict_case(case, devices, cluster)
            else:
                report = compile_case(case, devices, cluster)
                compiled, memory = report.measured.memory_bytes, report.predicted.memory
                seconds = round(time.perf_counter() - start, 1)
                cache[case.name] = compiled
                cache_path.parent.mkdir(parents=True, exist_ok=True)
                partial = cache_path.with_suffix(".part")  # renamed whole, so a reader never sees half
                partial.write_text(json.dumps(cache, indent=0))
                partial.replace(cache_path)
        except Exception as e:  # a case that does not compile is reported, not fatal
            print(f"{case.name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            rows.append({**dataclasses.asdict(case), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        r = row(case, compiled, memory, seconds)
        rows.append(r)
        print(
            f"{case.name}: compiled {r['compiled']:,} predicted {r['predicted']:,} ({r['peak']}) "
            f"ratio {r['ratio']:.3f} [{seconds} s]",
            flush=True,
        )
    if args.no_file:
        return
    write(rows, backend, cluster, Path(args.out), args.compiled_with or jaxlib.__version__)


def write(rows: list[dict[str, Any]], backend: str, cluster: Cluster, out: Path, compiled_with: str) -> None:
    ok = [r for r in rows if "ratio" in r]
    ratios = [r["ratio"] for r in ok]
    within = sum(abs(x - 1) <= 0.10 for x in ratios)
    stem = results_file.dated_stem(out, "memory_matrix", f"{backend}-jaxlib{compiled_with}")
    lines = [results_file.header(f"Memory matrix, {backend}-compiled: compiled ÷ predicted per device")]
    lines.append(
        f"{cluster.nodes} nodes × {cluster.devices_per_node} devices, compiled by jaxlib {compiled_with}. "
        "compiled: XLA's `memory_analysis()` "
        "(arguments + outputs − aliases + temporaries); predicted: `cost.memory(...).total` and its peak.\n"
    )
    if ratios:
        lines.append(
            f"**{len(ok)} cases: ratio {min(ratios):.3f}-{max(ratios):.3f}, {within} within ±10 %.** "
            f"{len(rows) - len(ok)} did not compile.\n"
        )
    tensor = [r["ratio"] for r in ok if r["strategy"].startswith("t=")]
    if tensor and len(tensor) < len(ok):
        inside = sum(abs(x - 1) <= 0.10 for x in tensor)
        lines.append(
            f"Of them {len(tensor)} with a tensor axis: ratio {min(tensor):.3f}-{max(tensor):.3f}, {inside} "
            "within ±10 %; the rest are the same shapes without one, for reference.\n"
        )
    lines.append(
        "| model | seq | B | M | remat | precision | strategy | SP | compiled B | predicted B | peak | ratio"
        " |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sp = ("on" if r.get("sequence_parallel", True) else "off") if r["strategy"].startswith("t=") else "-"
        head = (
            "| "
            + " | ".join(str(r[k]) for k in ("model", "seq", "batch", "micro_batches", "remat", "precision"))
            + f" | `{r['strategy']}` | {sp} |"
        )
        if "ratio" in r:
            lines.append(f"{head} {r['compiled']:,} | {r['predicted']:,} | {r['peak']} | {r['ratio']:.3f} |")
        else:
            lines.append(f"{head} {r['error']} | | | |")
    (stem.parent / f"{stem.name}.md").write_text("\n".join(lines) + "\n")
    (stem.parent / f"{stem.name}.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {stem}.md")


if __name__ == "__main__":
    main()
