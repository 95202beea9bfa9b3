"""`benchmarks/optimizer_update.py`: the cost model's update rules equal the compiled update at scale."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_update_rules_equal_the_compiled_update_of_llama_7b_leaves_on_1024_devices():
    # Compile only, one leaf at a time: every Muon case (rows split with R < k and with R >= k, the
    # contracted dimension split) and Adafactor, under ZeRO-3 and AMSP's 7B placement at 128 x 8.
    # The child sets its own device count; it keeps the other XLA flags and the compilation cache.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.optimizer_update", "--nodes", "128",
         "--strategies", "zero3;p=1x1,g=1x1,os=8x1", "--optimizers", "muon,adafactor",
         "--leaves", "wq,wo,w2,lm_head", "--check"],
        capture_output=True, text=True, check=False, env=env, cwd=REPO,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout + child.stderr
    assert child.stdout.count(" ok ") == 16
