"""One rank of a parity launch: train every case of the spec file in turn; rank 0 saves each record."""

import json
import os
import sys
from pathlib import Path

import torch

from lightning_4d import ParallelDims
from tests.parity import Case, train


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    world_size = int(os.environ["WORLD_SIZE"])
    num_nodes = spec["num_nodes"]
    for fields in spec["cases"]:
        case = Case(**fields)
        sizes = {name: case.strategy.get(name, default) for name, default in
                 (("dp", "auto"), ("pp", 1), ("cp", 1), ("tp", 1))}
        dp = ParallelDims.resolve(world_size, **sizes).dp
        record = train(case, distributed=True, dp=dp, devices=world_size // num_nodes, num_nodes=num_nodes,
                       workdir=spec["out"])
        if record["rank"] == 0:
            torch.save(record, Path(spec["out"]) / f"{case.name}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
