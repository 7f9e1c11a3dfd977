"""A toy model family for the tests, added the way a new model is: one folder and one registry line."""
import sys
from pathlib import Path

from utils.families import FAMILIES, FamilyInfo, register

NAME = "toy"
# GPT-2's model code under another name: what a new family's train.py defines, in the fewest lines.
TRAIN_PY = '''"""Toy family: GPT-2's code under another name (tests/toy_family.py)."""
import dataclasses
import sys

from gpt2.train import GPT2_FAMILY
from utils.trainer import main as run_training

TOY_FAMILY = dataclasses.replace(GPT2_FAMILY, name="toy", title="Toy family: GPT-2's code under another name.")


def main(argv=None) -> int:
    return run_training(TOY_FAMILY, argv)


if __name__ == "__main__":
    sys.exit(main())
'''


def add_toy_family(root: Path) -> FamilyInfo:
    """Write root/toy/ (its train.py), put root on sys.path and register the family; remove_toy_family undoes it."""
    folder = Path(root) / NAME
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text("", encoding="utf-8")
    (folder / "train.py").write_text(TRAIN_PY, encoding="utf-8")
    sys.path.insert(0, str(root))
    return register(FamilyInfo(NAME, "Toy", default_model="tiny", objective="causal"))


def remove_toy_family(root: Path) -> None:
    FAMILIES.pop(NAME, None)
    if str(root) in sys.path:
        sys.path.remove(str(root))
    for module in [m for m in sys.modules if m == NAME or m.startswith(f"{NAME}.")]:
        del sys.modules[module]
