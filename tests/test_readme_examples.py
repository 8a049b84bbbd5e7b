"""The README's Python examples run as written (on the in-process stores they use)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:  # in order: a later example may use an earlier one's names
        exec(compile(block, str(README), "exec"), namespace)
