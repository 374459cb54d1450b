"""The size of every module and class of the package, largest first, against the targets a
reader holds the code to (modules ~600 lines, classes ~400): the ones over are marked.

    python scripts/module_sizes.py [--all]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MODULE_TARGET = 600
CLASS_TARGET = 400
ROOT = Path(__file__).resolve().parent.parent / "celery_resilient"


def sizes() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    modules, classes = [], []
    for path in sorted(ROOT.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        text = path.read_text()
        name = str(path.relative_to(ROOT.parent))
        modules.append((len(text.splitlines()), name))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                classes.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
    return sorted(modules, reverse=True), sorted(classes, reverse=True)


def main(argv: list[str]) -> int:
    show_all = "--all" in argv
    modules, classes = sizes()
    for title, rows, target in (("modules", modules, MODULE_TARGET),
                                ("classes", classes, CLASS_TARGET)):
        over = [r for r in rows if r[0] > target]
        print(f"## {title}: {len(over)} of {len(rows)} over {target} lines")
        for lines, name in rows if show_all else rows[:max(len(over), 10)]:
            print(f"{lines:6d}  {name}{'  <- over' if lines > target else ''}")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
