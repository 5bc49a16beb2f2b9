"""A failure on one rank ends every rank quickly, names the failing rank, and leaves checkpoints loadable."""

import torch

from lightning_4d import checkpoint
from tests.models import Classifier
from tests.parity import Case, run_layout


def test_exception_on_one_rank_ends_the_job_and_keeps_the_last_checkpoint(tmp_path):
    # Rank 1 raises at step 3; a ModelCheckpoint wrote step 2 before that.
    case = Case("fail", module="tests.models:Classifier", data="tests.models:classification_data",
                strategy={"dp": 4}, max_steps=8, resume_at=2, callbacks=["tests.probes:FailOnRank"])
    result = run_layout([case], 4, timeout=120, workdir=str(tmp_path))
    assert result.elapsed < 60, f"the job took {result.elapsed:.0f} s to end\n{result.output[-3000:]}"
    assert all(code != 0 for code in result.returncodes), result.returncodes
    assert "RuntimeError: injected failure on rank 1 at step 3" in result.output
    # Every other rank says which rank failed first, with its traceback.
    assert result.output.count("stopped because rank 1 failed first:") == 3, result.output[-4000:]

    saved = sorted((tmp_path / "fail").iterdir())
    assert [p.name for p in saved] == ["epoch=0-step=2.ckpt"], saved
    module = Classifier()
    optimizer = module.configure_optimizers()["optimizer"]
    meta = checkpoint.load(saved[0], module, [optimizer])  # one process, no process group
    assert meta["global_step"] == 2
    assert optimizer.state_dict()["state"][0]["step"] == torch.tensor(2.0)
