"""EarlyStopping, ModelCheckpoint(monitor=...), test/predict loops and Lightning's collectives under dp=2."""

import json
import os
import subprocess
import sys

from tests.parity import ROOT, script_env


def test_lightning_features_work_under_fourd(tmp_path):
    env = script_env()
    done = subprocess.run([sys.executable, "tests/lightning_features_script.py", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "terminate called" not in done.stderr, done.stderr[-4000:]  # the second rank aborting at exit
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["stopped"] == 1 and result["epochs"] == 2, result  # EarlyStopping ended fit on both ranks
    assert result["best"].endswith(".ckpt") and os.path.isdir(result["best"]), result
    assert set(result["test"][0]) == {"test_loss"}
    assert result["predictions"] == 32  # 64 samples, half predicted on each rank's share (rank 0 reports)
    assert result["gathered_shape"] == [2, 1]  # one value per data-parallel replica
    assert result["broadcast"] == "from rank 0" and result["reduced"] == 2.0
