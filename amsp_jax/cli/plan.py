"""`amsp-jax plan`: the fastest strategy that fits, beside the usual presets, with time, memory and bytes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from amsp_jax.core.config_files import shipped
from amsp_jax.core.plan import REMAT_POLICIES
from amsp_jax.cost import host_profile
from amsp_jax.cost.hardware import ClusterConfig
from amsp_jax.cost.optimizer import KINDS
from amsp_jax.cost.trace import from_entry_point
from amsp_jax.models.llama import llama_spec
from amsp_jax.planner import PlanError, PricedPlan, make_request, price_alternatives
from amsp_jax.planner.request import GIB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `plan` subcommand's flags."""
    models, clusters = ", ".join(shipped("models")), ", ".join(shipped("clusters"))
    parser.add_argument(
        "--model",
        required=True,
        help=f"model YAML, a shipped model ({models}), or any Flax model from a Python entry point "
        "module:function or file.py:function returning (model, example_inputs)",
    )
    parser.add_argument(
        "--cluster",
        required=True,
        help=f"cluster YAML, a shipped cluster ({clusters}), or host: this host's CPU mesh of --nodes x 4 "
        "devices, priced with its own profile (measured on first use, then cached)",
    )
    parser.add_argument("--nodes", type=int, help="number of nodes (default: the cluster config's)")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--global-batch-tokens", type=int, required=True, help="tokens per optimizer step")
    parser.add_argument(
        "--strategy", help="evaluate this strategy (e.g. p=1x1,g=1x1,os=8x1, or zero3) instead"
    )
    parser.add_argument(
        "--micro-batch-size", type=int, help="fix the micro-batch size instead of searching it"
    )
    parser.add_argument(
        "--remat", choices=REMAT_POLICIES, help="fix the remat policy instead of searching it"
    )
    parser.add_argument("--precision", default="mixed", choices=("mixed", "fp32"), help="default: mixed")
    parser.add_argument(
        "--optimizer",
        default="adam",
        choices=KINDS,
        help="adam (any element-wise optimizer: no communication of its own), adafactor, or muon on "
        "every matrix; the collectives XLA adds to the update are priced (default: adam)",
    )
    parser.add_argument(
        "--keep-first-layer",
        action="store_true",
        help="plans with micro-batches keep each layer stack's first layer gathered for the step (its "
        "memory counted)",
    )
    parser.add_argument(
        "--tensor",
        default="auto",
        help="tensor-parallel degrees to search: auto (every divisor of the devices per node that the "
        "model's split dimensions allow) or a list such as 1,2 (default: auto)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _row(e: PricedPlan) -> list[str]:
    t, levels = e.estimate.time, e.estimate.prediction.bytes_by_level()
    return [
        e.name,
        e.description,
        str(e.micro_batch_size),
        str(e.micro_batches),
        e.remat,
        f"{t.step_s:.3f}",
        f"{100 * t.mfu:.1f}%",
        f"{t.tokens_per_s(e.devices):,.0f}",
        f"{e.memory_bytes / GIB:.1f}" + ("" if e.feasible else " !"),
        f"{levels['intra'] / 1e9:.2f}",
        f"{levels['inter'] / 1e9:.2f}",
    ]


HEADER = [
    "name",
    "strategy",
    "b",
    "M",
    "remat",
    "step s",
    "MFU",
    "tokens/s",
    "GiB/dev",
    "intra GB",
    "inter GB",
]


def format_table(rows: list[list[str]]) -> str:
    """Columns padded to their widest cell."""
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [HEADER, *rows]
    ]
    return "\n".join(lines)


def provenance(hardware: ClusterConfig) -> str:
    """Where and when the cluster config was measured, and, for a CPU profile of another host, that it
    prices that host ('' for a config that does not say, as the datasheet-built GPU ones)."""
    if not hardware.provenance:
        return ""
    line = f"{hardware.name}: {hardware.provenance}"
    if hardware.platform == "cpu" and not host_profile.is_this_host(hardware.measured_on):
        line += f"; not this host: --cluster {host_profile.HOST} prices with this host's own profile"
    return line


def _tensor_degrees(text: str) -> tuple[int, ...] | None:
    if text == "auto":
        return None
    parts = [part.strip() for part in text.split(",")]
    if not parts or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise PlanError(f"--tensor {text!r} is not auto or a list of positive integers; write e.g. 1,2,4")
    return tuple(int(part) for part in parts)


def run(args: argparse.Namespace) -> int:
    """Plan (or evaluate `--strategy`), print the chosen plan beside the presets.

    Errors (nothing fits, a bad strategy or config) propagate to `amsp_jax.cli.main`, which prints them
    as one line and exits with code 2.
    """
    model = args.model
    spec = from_entry_point(model) if ":" in model and not Path(model).exists() else llama_spec(model)
    request = make_request(
        spec,
        args.cluster,
        args.nodes,
        seq_len=args.seq_len,
        global_batch_tokens=args.global_batch_tokens,
        precision=args.precision,
        micro_batch_size=args.micro_batch_size,
        remat=args.remat,
        optimizer=args.optimizer,
        keep_first_layer=args.keep_first_layer,
        tensor_degrees=_tensor_degrees(args.tensor),
    )
    priced = price_alternatives(request, args.strategy)
    chosen, rows, solve_time = priced.chosen, [*priced.by_tensor, *priced.presets], priced.solve_time_s

    hardware = request.cluster
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "cluster": hardware.name,
                    "nodes": hardware.nodes,
                    "devices_per_node": hardware.devices_per_node,
                    "seq_len": request.seq_len,
                    "global_batch_tokens": request.global_batch_tokens,
                    "memory_limit_bytes": hardware.memory_limit,
                    "measured_on": dict(hardware.measured_on or {}),
                    "solve_time_s": solve_time,
                    "optimizer": args.optimizer,
                    "chosen": chosen.as_dict(),
                    "alternatives": [r.as_dict() for r in rows],
                },
                indent=2,
            )
        )
    else:
        what = "evaluated --strategy" if args.strategy else "chosen by the ILP"
        print(
            f"{request.model.name} ({request.model.num_params() / 1e9:.2f}B params) on {hardware.name}: "
            f"{hardware.nodes} nodes x {hardware.devices_per_node} = {request.devices} devices, seq "
            f"{request.seq_len}, {request.global_batch_tokens:,} tokens per step "
            f"({request.sequences_per_device()} sequence(s) per device)"
        )
        print(
            f"memory per device: {hardware.memory_limit / GIB:.1f} GiB usable; 'chosen' {what} in "
            f"{solve_time:.2f} s"
        )
        if where := provenance(hardware):
            print(where)
        print()
        print(format_table([_row(chosen), *(_row(r) for r in rows)]))
        if args.optimizer != "adam":
            print()
            print(f"of which the {args.optimizer} update's own collectives (per device and step):")
            for r in [chosen, *rows]:
                intra, inter = (r.update_bytes()[level] / 1e9 for level in ("intra", "inter"))
                print(f"  {r.name:<8}intra {intra:,.2f} GB  inter {inter:,.2f} GB")
        for r in [chosen, *rows]:
            if not r.feasible:
                print(f"  ! {r.name}: {r.reason}")
    return 0 if chosen.feasible else 1
