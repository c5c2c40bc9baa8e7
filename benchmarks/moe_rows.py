"""What a verification step's rows cost one mixture-of-experts MLP: distinct experts touched and time, by rows.

One random MoE layer (default 64 experts, top-8, hidden 1024, each expert 256 wide, fp32 or Q4_0 blocks on
the C GEMM) runs `MoEMLP` on n random rows for each n of --sizes; per n it prints the median time over
--repeats calls, the experts the rows touched (each runs once on the rows that picked it), and a dense MLP
as wide as the active experts (top_k x moe_intermediate) at the same rows for comparison. Random rows
route independently, the worst case: consecutive tokens of one sequence share experts more often.

    .venv/bin/python benchmarks/moe_rows.py --sizes 1,2,5,9,17 --json moe_rows.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specserve.models.llama import make_linear
from specserve.models.moe import MoEConfig, MoEMLP
from specserve.ops import kernels


def random_weight(rows: int, cols: int, qtype: str, g: torch.Generator):
    """A random [rows, cols] weight, fp32 or a QuantizedWeight of GGUF type `qtype`."""
    w = torch.randn(rows, cols, generator=g) * cols ** -0.5
    if qtype == "fp32":
        return w
    import gguf

    from specserve.models.gguf_quant import QuantizedWeight

    kind = gguf.GGMLQuantizationType[qtype.upper()]
    return QuantizedWeight.from_gguf(gguf.quants.quantize(w.numpy(), kind), qtype.upper(), (rows, cols))


def random_weights(moe: MoEConfig, hidden: int, qtype: str, g: torch.Generator) -> dict:
    """One layer's router and experts under Qwen's per-expert names."""
    weights = {"mlp.gate.weight": torch.randn(moe.num_experts, hidden, generator=g) * hidden ** -0.5}
    for e in range(moe.num_experts):
        weights[f"mlp.experts.{e}.gate_proj.weight"] = random_weight(moe.intermediate_size, hidden, qtype, g)
        weights[f"mlp.experts.{e}.up_proj.weight"] = random_weight(moe.intermediate_size, hidden, qtype, g)
        weights[f"mlp.experts.{e}.down_proj.weight"] = random_weight(hidden, moe.intermediate_size, qtype, g)
    return weights


def median_ms(fn, x: torch.Tensor, repeats: int) -> float:
    fn(x)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,2,5,9,17")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--weights", default="fp32", choices=["fp32", "q4_0", "q8_0"])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--python-loop", action="store_true",
                   help="run the experts as a Python loop of GEMM calls instead of one C call (fused.moe_experts)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()

    g = torch.Generator().manual_seed(0)
    moe = MoEConfig(num_experts=args.experts, top_k=args.top_k, intermediate_size=args.moe_intermediate,
                    norm_topk_prob=True)
    weights = random_weights(moe, args.hidden, args.weights, g)
    mlp = MoEMLP(moe, weights, "", lambda w, b=None: make_linear(w, b), kernels.kernel_usable(torch.float32))
    if args.python_loop:
        mlp._c_experts = None
    active = args.top_k * args.moe_intermediate
    dense_gate_up = make_linear(random_weight(2 * active, args.hidden, args.weights, g))
    dense_down = make_linear(random_weight(args.hidden, active, args.weights, g))

    def dense(x):
        return dense_down(mlp._silu_mul(dense_gate_up(x)))

    results = []
    with torch.inference_mode():
        for n in (int(s) for s in args.sizes.split(",")):
            h = torch.randn(n, args.hidden, generator=g)
            touched = mlp.route(h)[1].unique().numel()
            results.append({"rows": n, "experts_touched": touched, "moe_ms": median_ms(mlp, h, args.repeats),
                            "dense_active_ms": median_ms(dense, h, args.repeats)})

    base = results[0]["moe_ms"]
    print(f"MoE MLP: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert width "
          f"{args.moe_intermediate}, {args.weights} weights; median of {args.repeats} calls, torch threads "
          f"{torch.get_num_threads()}")
    print(f"{'rows':>5} {'experts':>8} {'ms':>8} {'x 1 row':>8} {'ms/expert':>10} {'dense ms':>9}")
    for r in results:
        print(f"{r['rows']:>5} {r['experts_touched']:>8} {r['moe_ms']:8.3f} {r['moe_ms'] / base:8.2f} "
              f"{r['moe_ms'] / r['experts_touched']:10.4f} {r['dense_active_ms']:9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
