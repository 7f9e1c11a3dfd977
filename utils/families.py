"""The model families this project trains: the one place a model is declared.

A family is a folder (`gpt2/`, `bert/`) with a `train.py` that defines its `ModelFamily` (utils/trainer.py) and a
`config.py` with its named sizes. The registry below holds what the launchers and benchmarks need without importing
torch; `load_family(name)` imports the folder's training definition. Adding a model = one folder + one line here.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyInfo:
    """What is known of a family before torch is imported.

    name: the folder and the --model value of the launchers (`gpt2`).
    label: how people write it (`GPT-2`).
    default_model: --model-name on GPUs (a named size of the family, or a hub id).
    objective: `causal` or `masked` language modelling.
    default_size: default_model's parameter count as tables write it (`124M`).
    context_length: default_model's positions: the sequence length the benchmarks run it at on GPUs.
    """

    name: str
    label: str
    default_model: str
    objective: str
    default_size: str = ""
    context_length: int = 512

    @property
    def train_module(self) -> str:
        return f"{self.name}.train"

    @property
    def train_script(self) -> str:
        return f"{self.name}/train.py"


FAMILIES: dict[str, FamilyInfo] = {}


def register(info: FamilyInfo) -> FamilyInfo:
    """Add a family to the registry (tests register toy families; an existing name is refused)."""
    if info.name in FAMILIES:
        raise ValueError(f"model family {info.name!r} is already registered")
    FAMILIES[info.name] = info
    return info


register(FamilyInfo("gpt2", "GPT-2", default_model="gpt2", objective="causal", default_size="124M", context_length=1024))
register(FamilyInfo("bert", "BERT", default_model="bert-base-uncased", objective="masked", default_size="110M"))


def family_info(name: str) -> FamilyInfo:
    """The registered family `name`, or a ValueError listing the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r} (known: {', '.join(FAMILIES)})") from None


def load_family(name: str):
    """The family's ModelFamily (imports torch and transformers): `<name>.train.<NAME>_FAMILY` or `FAMILY`."""
    module = importlib.import_module(family_info(name).train_module)
    for attribute in (f"{name.upper()}_FAMILY", "FAMILY"):
        if hasattr(module, attribute):
            return getattr(module, attribute)
    raise ValueError(f"{module.__file__}: defines no {name.upper()}_FAMILY or FAMILY")


def train_main(argv: list[str] | None = None) -> int:
    """`mosim-train FAMILY [flags]`: one registered family's training, with its train.py's flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-"):
        print(f"usage: mosim-train {{{','.join(FAMILIES)}}} [flags]  (`mosim-train gpt2 --help` lists the flags)",
              file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if argv[0] not in FAMILIES:
        print(f"error: unknown model family {argv[0]!r}", file=sys.stderr)
        return 2
    from utils.environment import require
    require("training")  # `pip install .[convert]` installs this command too: one line, not a torch traceback
    from utils.trainer import main as train

    return train(load_family(argv[0]), argv[1:])
