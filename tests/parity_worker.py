"""One rank of a parity launch: train every case of the spec file in turn; every rank saves its record (rank 0's
``<name>.pt``, the others' ``<name>.rank<r>.pt``), so that a rank or replica that drifted is seen
(:func:`tests.parity.run_layout` compares them with rank 0's).

Cases under ``"failing"`` are expected to raise: every rank writes what it raised (or ``no error``) to
``<name>.rank<r>.txt``, for the test to judge that each rank stopped with the right message.
"""

import json
import os
import sys
from pathlib import Path

import torch

from tests.parity import Case, train


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out, world_size, rank = Path(spec["out"]), int(os.environ["WORLD_SIZE"]), os.environ["RANK"]
    num_nodes = spec.get("num_nodes", 1)

    def run(case: Case) -> dict:
        return train(case, distributed=True, devices=world_size // num_nodes, num_nodes=num_nodes,
                     workdir=spec["out"])

    for fields in spec["cases"]:
        record = run(Case(**fields))
        name = fields["name"] if record["rank"] == 0 else f"{fields['name']}.rank{record['rank']}"
        torch.save(record, out / f"{name}.pt")
    for fields in spec.get("failing", []):
        try:
            run(Case(**fields))
            outcome = "no error"
        except Exception as error:  # noqa: BLE001  recorded for the test to judge
            outcome = f"{type(error).__name__}: {error}"
        (out / f"{fields['name']}.rank{rank}.txt").write_text(outcome)


if __name__ == "__main__":
    main(sys.argv[1])
