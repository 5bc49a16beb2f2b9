"""Expert parallelism's local compute on a GPU: each rank's share of the experts, run by transformers' own
``experts_implementation`` on a view holding that rank's weights, against the whole layer in one process.

    python bench/gpu_experts.py [--ep 2 4] [--dtypes float32 bfloat16]

No process group is needed (one GPU): for each simulated rank of ``--ep`` the tokens routed to its experts are
gathered as :class:`~lightning_4d.expert_parallel.AllToAllDispatch` gathers them (grouped by expert, local
expert ids), :meth:`~lightning_4d.modules.experts.ExpertsForward.compute` runs them with that rank's slice of
``gate_up_proj``/``down_proj``, and the weighted results are added back. On CUDA ``grouped_mm`` calls
``torch._grouped_mm`` (CPU runs its fallback), so this checks the view and the local expert ids on the kernels a
GPU uses. The reference is the same layer's ``eager`` forward on all its experts. Prints the largest absolute
difference relative to the output's largest magnitude.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from lightning_4d.modules.experts import ExpertsForward  # noqa: E402


def simulated(experts: torch.nn.Module, implementation: str, ep: int, hidden: torch.Tensor, index: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """The layer's output when ``ep`` ranks each compute their E/ep experts (no communication: one device)."""
    total = experts.gate_up_proj.shape[0]
    local = total // ep
    experts.config._experts_implementation = implementation
    out = torch.zeros_like(hidden)
    chosen = index.reshape(-1)
    order = torch.argsort(chosen, stable=True)
    token_of = order // index.shape[1]
    whole = {name: getattr(experts, name) for name in ("gate_up_proj", "down_proj")}
    for rank in range(ep):
        mine = (chosen[order] // local) == rank
        rows, tokens = order[mine], token_of[mine]
        forward = ExpertsForward(experts)
        forward.local_experts = local
        forward.weights = lambda: {name: value[rank * local:(rank + 1) * local] for name, value in whole.items()}
        result = forward.compute(hidden[tokens], chosen[rows] - rank * local)
        weighted = result * weights.reshape(-1)[rows, None].to(result.dtype)  # as AllToAllDispatch combines
        out = out.index_add(0, tokens, weighted.to(out.dtype))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for dtype in args.dtypes:
        config = transformers.MixtralConfig(hidden_size=512, intermediate_size=1024, num_local_experts=8,
                                            num_experts_per_tok=2, num_hidden_layers=1)
        torch.manual_seed(0)
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.05)
        block = block.to(device, getattr(torch, dtype))
        hidden = torch.randn(args.tokens, config.hidden_size, device=device, dtype=getattr(torch, dtype))
        with torch.no_grad():
            _, weights, index = block.gate(hidden)
            block.experts.config._experts_implementation = "eager"
            expected = type(block.experts).forward(block.experts, hidden, index, weights)
            for implementation in ("eager", "batched_mm", "grouped_mm"):
                for ep in args.ep:
                    got = simulated(block.experts, implementation, ep, hidden, index, weights)
                    error = ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
                    rows.append({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                 "dtype": dtype, "implementation": implementation, "ep": ep, "max_rel_error": error})
                    print(f"{rows[-1]['device']} {dtype} {implementation} ep={ep}: max |diff| / max |out| = {error:.2e}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"command": "python bench/gpu_experts.py " + " ".join(sys.argv[1:]), "rows": rows}, handle,
                      indent=2)


if __name__ == "__main__":
    main()
