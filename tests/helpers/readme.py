"""What the README shows: the commands of its ``sh`` blocks, and its ``ftkit.hf`` example script."""

from __future__ import annotations

import re

from tests.helpers.paths import REPO


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
    cmds = []
    for block in blocks[1:]:  # the first block is the two set-up commands (make demo / make test)
        for line in block.splitlines():
            line = line.split("  #")[0].strip() if not line.startswith("#") else ""
            if line:
                cmds.append(line)
    return cmds


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Bring your own script", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code
