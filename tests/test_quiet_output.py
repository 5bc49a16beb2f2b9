"""The 16-process demo (dp=pp=cp=tp=2, examples/configs/demo.yaml, shortened) prints each warning once: no
copy per rank, no Lightning advertisement, no "weights_only was not set" after a save; and it prints the
training and validation loss on rank 0. One 16-process run, because that is where every-rank noise shows."""

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tests.parity import script_env
from tests.quiet_probe import PROBE_WARNING

ROOT = Path(__file__).resolve().parent.parent
WARNING_LINE = re.compile(r"^\S+\.py:\d+: .*$", re.M)  # how warnings.showwarning prints one


def test_the_16_process_demo_prints_each_warning_once(tmp_path):
    command = [sys.executable, "examples/train.py", "fit", "--config", "examples/configs/demo.yaml",
               "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
               "--model.n_layer", "2", "--data.max_bytes", "30000", "--trainer.default_root_dir", str(tmp_path),
               "--trainer.callbacks+=tests.quiet_probe.SaveAtEnd"]
    done = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert "lightning-4d layout: dp=2 pp=2 cp=2 tp=2 (world 16)" in out
    assert (tmp_path / "end.ckpt").is_dir(), "the probe's save did not happen"

    warnings = Counter(WARNING_LINE.findall(out))
    assert out.count(PROBE_WARNING) == 1, "rank 0 must still show a warning, once"
    assert all(count == 1 for count in warnings.values()), warnings
    # Lightning 2.6's own deprecation, dropped off rank 0 by lightning_4d._quiet: once where it is raised at all.
    assert out.count("`isinstance(treespec, LeafSpec)` is deprecated") <= 1
    assert out.count("Seed set to 1234") == 1 and out.count("Initializing distributed: GLOBAL_RANK") == 1
    assert "Tip:" not in out and "litlogger" not in out
    assert "weights_only` was not set" not in out
    assert re.search(r"^step +1  train_loss \d", out, re.M) and re.search(r"^step +2  val_loss \d", out, re.M)
