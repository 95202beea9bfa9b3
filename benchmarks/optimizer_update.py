"""What the optimizer's update moves at scale: the cost model's rules against compiled HLO, per leaf.

For every leaf of a LLaMA model, the real optax update of that leaf (Muon with the model's own
dimension numbers, or Adafactor) is compiled under jit for a CPU mesh of the cluster's size (compile
only: nothing runs), its master, gradient and optimizer state placed as the `Trainer` places them
for the strategy; the collectives of the compiled program (bytes per device, by kind and link level)
are set beside `amsp_jax.cost.optimizer`'s prediction. The step's own collectives are not part of
this program (the audit checks those, and the update's, on whole compiled steps).

`--whole-matrices` measures the layout distributed Muon implementations use instead: each device
owns whole matrices in turn (here: the layer stack's matrices split over the OS group by layer, so
each device orthogonalises L/k of them alone). The gradient and the parameter (for weight decay) are
moved to that layout inside the update and the update back, the momentum stays in it.

    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.optimizer_update --nodes 128 --whole-matrices
writes a dated benchmarks/results/optimizer_update_*.md (and .json); `--check` exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from amsp_jax.core.backend import cpu_flags  # noqa: E402
from benchmarks import results_file  # noqa: E402

GB = 1e9


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--strategies", default="zero3;p=1x1,g=1x1,os=8x1", help="';'-separated")
    parser.add_argument("--optimizers", default="muon,adafactor")
    parser.add_argument("--leaves", help="','-separated leaf names to check (default: all)")
    parser.add_argument(
        "--whole-matrices", action="store_true", help="also measure whole matrices per device"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if any leaf differs; write nothing")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="output directory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    devices = args.nodes * args.devices_per_node
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = cpu_flags(os.environ.get("XLA_FLAGS", ""), devices)
    from amsp_jax.core.config_files import find
    from amsp_jax.models.llama import LlamaConfig

    config = LlamaConfig.from_yaml(find("models", args.model))
    import amsp_jax as aj

    cluster = aj.Cluster(args.nodes, args.devices_per_node)
    rows, whole = [], []
    for strategy in args.strategies.split(";"):
        for kind in args.optimizers.split(","):
            rows += check_leaves(cluster, strategy, config, kind, args.leaves)
        if args.whole_matrices:
            whole += whole_matrices(cluster, strategy, config)
    bad = [r for r in rows if not r["match"]]
    for r in rows:
        mark = "ok" if r["match"] else "DIFFERS"
        name = f"{r['strategy']:<22}{r['optimizer']:<10}{r['leaf']:<34}"
        print(f"{name}{mark:<8}{r['predicted']} {r['compiled']}")
    if args.check:
        return 1 if bad else 0
    out = results_file.dated_stem(args.out, "optimizer_update", f"cpu{devices}-compiled")
    out.with_suffix(".json").write_text(json.dumps({"leaves": rows, "whole_matrices": whole}, indent=2))
    out.with_suffix(".md").write_text(report(args, config, rows, whole))
    print(f"wrote {out.with_suffix('.md')}")
    return 1 if bad else 0


def _leaves(config: Any) -> list[tuple[tuple[str, ...], tuple[int, ...], bool]]:
    from amsp_jax.cost import llama_workload

    return [(leaf.path, leaf.shape, leaf.stacked) for leaf in llama_workload(config, 1).leaves]


def _single_leaf_optimizer(kind: str, config: Any, path: tuple[str, ...]) -> Any:
    """The model's optimizer restricted to one leaf (its own Muon dimension numbers), or None."""
    import jax
    import numpy as np
    import optax

    from amsp_jax.models.llama import muon_dimension_numbers

    if kind == "adafactor":
        return optax.adafactor(1e-3)
    tree: dict[str, Any] = {}
    for p, shape, _ in _leaves(config):
        node = tree
        for key in p[:-1]:
            node = node.setdefault(key, {})
        node[p[-1]] = jax.ShapeDtypeStruct(shape, np.float32)
    numbers = muon_dimension_numbers(tree)
    for key in path:
        numbers = numbers[key]
    if numbers is None:
        return None  # Muon's AdamW: element-wise
    return optax.contrib.muon(1e-3, muon_weight_dimension_numbers={"w": numbers})


def _compiled_bytes(compiled: Any, layout: Any) -> dict[str, int]:
    from amsp_jax.compiled import hlo

    node = layout.node_of_device()
    totals: dict[str, int] = {}
    for c in hlo.parse_collectives(compiled.as_text(), layout.cluster.num_devices):
        size = hlo.bytes_per_device(c)
        if not c.scalar and size:
            key = f"{c.kind} {'inter' if hlo.crosses(c, node) else 'intra'}"
            totals[key] = totals.get(key, 0) + size
    return dict(sorted(totals.items()))


def _compile_update(opt: Any, layout: Any, leaf: Any, inner: Any | None = None) -> Any:
    """The jitted update of one leaf `w` placed as `leaf` says (`inner`: the layout the update runs in)."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from amsp_jax.core import optim_state

    params = {"w": jax.ShapeDtypeStruct(leaf.shape, np.float32)}
    abstract = optim_state.abstract_state(opt, params)
    specs = optim_state.state_specs(abstract, {("w",): inner or leaf})
    state = jax.tree.map(lambda s: NamedSharding(layout.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    placed = {"w": NamedSharding(layout.mesh, leaf.specs["opt_state"])}

    def update(grads: Any, opt_state: Any, master: Any) -> Any:
        g, p = grads, master
        if inner is not None:
            moved = {"w": NamedSharding(layout.mesh, inner.specs["opt_state"])}
            g, p = jax.lax.with_sharding_constraint((g, p), (moved, moved))
        updates, opt_state = opt.update(g, opt_state, p)
        if inner is not None:
            # Finished where it was computed (else GSPMD gathers the last B to compute B·X in place).
            updates = jax.lax.with_sharding_constraint(updates, moved)
        updates = jax.lax.with_sharding_constraint(updates, placed)
        return optax.apply_updates(master, updates), opt_state

    jitted = jax.jit(update, in_shardings=(placed, state, placed), out_shardings=(placed, state))
    return jitted.lower(params, abstract, params).compile()


def check_leaves(cluster: Any, strategy: str, config: Any, kind: str, only: str | None) -> list[dict]:
    """Per leaf: the rules' bytes beside the compiled update's, by kind and level."""
    import jax
    import numpy as np

    import amsp_jax as aj
    from amsp_jax import cost
    from amsp_jax.core import mesh as sharding
    from amsp_jax.core.leaf import Leaf
    from amsp_jax.cost import optimizer as optimizer_cost

    layout = sharding.make_layout(cluster, aj.resolve(strategy, cluster))
    rows = []
    for path, shape, stacked in _leaves(config):
        if only and path[-1] not in only.split(","):
            continue
        opt = _single_leaf_optimizer(kind, config, path)
        if opt is None:
            continue
        rules = optimizer_cost.describe(opt, {"w": jax.ShapeDtypeStruct(shape, np.float32)})
        leaf = sharding.leaf_layout(layout, Leaf(("w",), shape, stacked), not rules.communicates_on(("w",)))
        predicted: dict[str, int] = {}
        workload = cost.Workload((), cost.llama_dims(config), 1, 1, 1, min_collective_itemsize=4)
        for op in optimizer_cost.update_ops(layout, ("w",), leaf, rules):
            t = cost.transfer(op, workload)
            predicted[f"{t.kind} {t.level}"] = predicted.get(f"{t.kind} {t.level}", 0) + t.bytes
        start = time.perf_counter()
        compiled = _compiled_bytes(_compile_update(opt, layout, leaf), layout)
        rows.append(
            {
                "strategy": strategy,
                "optimizer": kind,
                "leaf": "/".join(path),
                "shape": list(shape),
                "split_dim": leaf.dim,
                "os_group": layout.size(layout.axes("opt_state")),
                "predicted": dict(sorted(predicted.items())),
                "compiled": compiled,
                "match": dict(sorted(predicted.items())) == compiled,
                "compile_s": round(time.perf_counter() - start, 2),
            }
        )
    return rows


def whole_matrices(cluster: Any, strategy: str, config: Any) -> list[dict]:
    """Muon's update with each device owning whole matrices (the layer stacks split by layer over the
    OS group), beside the placement the Trainer uses; leaves that cannot be split so are left out."""
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import amsp_jax as aj
    from amsp_jax.core import mesh as sharding
    from amsp_jax.core.leaf import Leaf

    layout = sharding.make_layout(cluster, aj.resolve(strategy, cluster))
    axes = layout.axes("opt_state")
    k = layout.size(axes)
    rows = []
    for path, shape, stacked in _leaves(config):
        opt = _single_leaf_optimizer("muon", config, path)
        if opt is None or not stacked or shape[0] % k:
            continue
        # Split as the Trainer splits it.
        leaf = sharding.leaf_layout(layout, Leaf(path, shape, stacked), major_first=False)
        entry = axes if len(axes) > 1 else axes[0]
        spec = P(entry, *([None] * (len(shape) - 1)))
        owned = sharding.LeafLayout(
            Leaf(path, tuple(shape), stacked), 0, {c: spec for c in ("params", "grads", "opt_state")},
            tuple(shape),
            axis_dims=tuple((a, 0) for a in axes),
        )  # fmt: skip
        split = _compiled_bytes(_compile_update(opt, layout, leaf), layout)
        by_layer = _compiled_bytes(_compile_update(opt, layout, leaf, owned), layout)
        rows.append(
            {
                "strategy": strategy,
                "leaf": "/".join(path),
                "shape": list(shape),
                "matrices_per_device": shape[0] // k,
                "split_layout": split,
                "whole_matrices": by_layer,
                "fp32_bytes_per_device_of_the_leaf": int(np.prod(shape)) * 4 // k,
            }
        )
    return rows


def _gb(totals: dict[str, int], level: str) -> float:
    return sum(v for key, v in totals.items() if key.endswith(level)) / GB


def report(args: argparse.Namespace, config: Any, rows: list[dict], whole: list[dict]) -> str:
    """The results as Markdown."""
    lines = [
        results_file.header(
            "The optimizer update's collectives: the cost model's rules against compiled HLO"
        ).rstrip(),
        "",
        f"{args.model} on {args.nodes} x {args.devices_per_node} = {args.nodes * args.devices_per_node} "
        "devices (CPU mesh, compile only). Per leaf: the real optax update of that leaf, placed as the "
        "`Trainer` places it; bytes per device and step (ring convention, as the audit counts them).",
        "Written by `python -m benchmarks.optimizer_update "
        f"--nodes {args.nodes}{' --whole-matrices' if args.whole_matrices else ''}`.",
        "",
    ]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["strategy"], r["optimizer"]), []).append(r)
    for (strategy, kind), items in groups.items():
        total_p = {lv: sum(_gb(r["predicted"], lv) for r in items) for lv in ("intra", "inter")}
        total_c = {lv: sum(_gb(r["compiled"], lv) for r in items) for lv in ("intra", "inter")}
        matched = sum(r["match"] for r in items)
        lines += [
            f"## {kind}, {strategy} (OS group {items[0]['os_group']})",
            "",
            f"{matched} of {len(items)} leaves equal. Total per device and step: predicted "
            f"{total_p['intra']:,.2f} GB intra + {total_p['inter']:,.2f} GB inter; compiled "
            f"{total_c['intra']:,.2f} + {total_c['inter']:,.2f} GB.",
            "",
            "| leaf | shape | split dim | predicted GB (intra / inter) | compiled GB | equal |",
            "|---|---|---|---|---|---|",
        ]
        for r in items:
            lines.append(
                f"| {r['leaf']} | {tuple(r['shape'])} | {r['split_dim']} | "
                f"{_gb(r['predicted'], 'intra'):,.3f} / {_gb(r['predicted'], 'inter'):,.3f} | "
                f"{_gb(r['compiled'], 'intra'):,.3f} / {_gb(r['compiled'], 'inter'):,.3f} | "
                f"{'yes' if r['match'] else 'NO'} |"
            )
        lines.append("")
    if whole:
        lines += [
            "## Muon with whole matrices per device",
            "",
            "Each layer stack's matrices split by layer over the OS group (L/k whole matrices per device), "
            "compiled beside the Trainer's placement (split along one matrix dimension). GB per device "
            "and step, every collective (intra / inter).",
            "",
            "| strategy | leaf | matrices per device | split layout | whole matrices | by kind |",
            "|---|---|---|---|---|---|",
        ]
        for r in whole:
            kinds = ", ".join(f"{k} {v / GB:,.3f}" for k, v in r["whole_matrices"].items())
            split, owned = r["split_layout"], r["whole_matrices"]
            lines.append(
                f"| {r['strategy']} | {r['leaf']} | {r['matrices_per_device']} | "
                f"{_gb(split, 'intra'):,.2f} / {_gb(split, 'inter'):,.2f} | "
                f"{_gb(owned, 'intra'):,.3f} / {_gb(owned, 'inter'):,.3f} | {kinds} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
