"""The README's quick start runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quick_start_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python block"
    quick_start = blocks[0]
    assert len(quick_start.strip().splitlines()) < 30
    exec(compile(quick_start, str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "gathering   per layer" in out
    losses = [float(line.split()[1]) for line in out.splitlines() if re.match(r"^\d ", line)]
    assert len(losses) == 3 and losses[-1] < losses[0]
