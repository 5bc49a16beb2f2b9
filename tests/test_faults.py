"""A failure on one rank ends every rank quickly, names the failing rank, and leaves checkpoints loadable."""

import re
import time

import torch

from lightning_4d import checkpoint
from tests.lm_models import tiny_gpt
from tests.models import Classifier
from tests.parity import Case, run_layout


def _check_job_ended(result) -> None:
    failed_at = float(re.search(r"injected failure on rank 1 at step 3 at t=([0-9.]+)", result.output).group(1))
    assert time.time() - failed_at < 60, f"the job took {time.time() - failed_at:.0f} s to end after the failure"
    # Every rank ended by itself (the launcher kills only after 90 s, with SIGKILL), each with a non-zero exit
    # status, none by a signal (an abort, SIGABRT, fails).
    assert all(code > 0 for code in result.returncodes), result.returncodes
    assert "RuntimeError: injected failure on rank 1 at step 3" in result.output
    # Every other rank says that rank 1 failed first, with its traceback: from its own failure's report, or from
    # its heartbeat thread when it was left waiting in a collective (faults/liveness.py, "blocked").
    silent = [rank for rank in range(len(result.returncodes))
              if rank != 1 and f"rank {rank} stopped because rank 1 failed first:" not in result.output]
    assert silent == [], f"ranks {silent} did not name rank 1\n{result.output[-4000:]}"


def test_exception_on_one_rank_ends_the_job_and_keeps_the_last_checkpoint(tmp_path):
    # Rank 1 raises at step 3; a ModelCheckpoint wrote step 2 before that.
    case = Case("fail", module="tests.models:Classifier", data="tests.models:classification_data",
                strategy={"dp": 4}, max_steps=8, resume_at=2, callbacks=["tests.probes:FailOnRank"])
    result = run_layout([case], 4, timeout=180, workdir=str(tmp_path), grace=90)
    # The surviving ranks meet first in the token-mean loss's all-reduce, where gloo fails only the ranks connected to
    # rank 1: the one left waiting there names rank 1 from its heartbeat thread (faults/liveness.py, "blocked").
    _check_job_ended(result)

    saved = sorted((tmp_path / "fail").iterdir())
    assert [p.name for p in saved] == ["epoch=0-step=2.ckpt"], saved
    module = Classifier()
    optimizer = module.configure_optimizers()["optimizer"]
    meta = checkpoint.load(saved[0], module, [optimizer])  # one process, no process group
    assert meta["global_step"] == 2
    assert optimizer.state_dict()["state"][0]["step"] == torch.tensor(2.0)


def test_exception_on_one_rank_of_a_4d_layout_ends_all_16(tmp_path):
    case = Case("fail4d", module="tests.lm_models:tiny_gpt", data="tests.lm_models:token_data",
                strategy={"dp": 2, "pp": 2, "cp": 2, "tp": 2, "pp_microbatches": 2}, batch_size=8, max_steps=8,
                resume_at=2,
                callbacks=["tests.probes:FailOnRank"])
    result = run_layout([case], 16, timeout=400, workdir=str(tmp_path), grace=90)
    _check_job_ended(result)
    saved = sorted((tmp_path / "fail4d").iterdir())
    assert [p.name for p in saved] == ["epoch=0-step=2.ckpt"], saved
    module = tiny_gpt()  # the sharded 4D checkpoint loads into one plain process
    optimizer = module.configure_optimizers()
    assert checkpoint.load(saved[0], module, [optimizer])["global_step"] == 2
