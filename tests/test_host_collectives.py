"""On CPU tensors (gloo) ``lightning_4d._compat``'s collectives take c10d's, never torch's functional ones (which
corrupt the heap there now and then: docs/troubleshooting.md), and give what the functional ones give: the same
values and the same gradients, bit for bit, on 2 ranks.

The worker is this module run under :func:`tests.parity.launch`; it writes what differed, per collective.
"""

import json
import sys
from pathlib import Path

from tests.parity import launch, rank_tails

CASES = ("all_reduce_sum", "all_reduce_max", "all_reduce_min", "all_gather", "all_gather_differentiable",
         "reduce_scatter", "all_to_all")


def test_host_collectives_match_the_functional_ones(tmp_path):
    codes, output = launch(["-m", "tests.test_host_collectives", str(tmp_path)], 2, timeout=120)
    assert codes == [0, 0], rank_tails(output)
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(found) == sorted(CASES), found
        assert all(found[case] == "same" for case in CASES), (rank, found)


def _cases(rank: int):
    """name -> call(compat, torch's functional collectives, group) -> (ours, theirs, (our gradient, theirs) or None)."""
    import torch

    torch.manual_seed(rank)
    x = torch.randn(4, 3, dtype=torch.float64)
    return {
        "all_reduce_sum": lambda c, f, g: (c.all_reduce_in_stream(x, "sum", g), f.all_reduce(x, "sum", g), None),
        "all_reduce_max": lambda c, f, g: (c.all_reduce_in_stream(x, "max", g), f.all_reduce(x, "max", g), None),
        "all_reduce_min": lambda c, f, g: (c.all_reduce_in_stream(x, "min", g), f.all_reduce(x, "min", g), None),
        "all_gather": lambda c, f, g: (c.all_gather_in_stream(x, g), f.all_gather_tensor(x, 0, g), None),
        "all_gather_differentiable": lambda c, f, g: _with_grad(
            x, lambda t: c.all_gather_in_stream(t, g, differentiable=True),
            lambda t: f.all_gather_tensor_autograd(t, 0, g)),
        "reduce_scatter": lambda c, f, g: _with_grad(
            x, lambda t: c.reduce_scatter_in_stream(t, g), lambda t: f.reduce_scatter_tensor_autograd(t, "sum", 0, g)),
        "all_to_all": lambda c, f, g: _with_grad(
            x, lambda t: c.all_to_all_in_stream(t, g), lambda t: f.all_to_all_single_autograd(t, None, None, g)),
    }


def _with_grad(x, ours, theirs):
    """Both outputs, and both gradients of the same weighted sum of each output."""
    import torch

    results = []
    for call in (ours, theirs):
        leaf = x.clone().requires_grad_(True)
        plain = call(leaf) * 1  # an AsyncCollectiveTensor is waited for by its first operation
        (plain * torch.arange(plain.numel(), dtype=plain.dtype).view_as(plain)).sum().backward()
        results.append((plain.detach(), leaf.grad))
    return results[0][0], results[1][0], (results[0][1], results[1][1])


def _refuse():
    raise AssertionError("lightning_4d reached torch's functional collectives with a CPU tensor")


def _worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as functional

    from lightning_4d import _compat as compat
    from lightning_4d.faults.report import destroy_process_groups_at_exit

    dist.init_process_group("gloo")
    destroy_process_groups_at_exit()  # the exit order FourDStrategy's runs have (docs/troubleshooting.md)
    group, rank = dist.group.WORLD, dist.get_rank()
    found = {}
    for name, case in _cases(rank).items():
        # the reference calls torch's functional collectives directly; lightning_4d reaches them only through
        # compat.functional_collectives, which refuses for the case
        original = compat.functional_collectives
        compat.functional_collectives = _refuse
        try:
            mine, reference, grads = case(compat, functional, group)
        finally:
            compat.functional_collectives = original
        same = isinstance(mine, torch.Tensor) and not compat.in_flight(mine) and torch.equal(mine, reference * 1)
        if grads is not None:
            same = same and torch.equal(grads[0], grads[1])
        found[name] = "same" if same else f"differs: {mine} vs {reference}, gradients {grads}"
    (out / f"rank{rank}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
