"""Print pip constraints that keep the installed torch and pick libraries that still support it (Docker build step)."""
from __future__ import annotations

import argparse
import importlib.metadata
import sys

# transformers 5 switches PyTorch off below 2.6 ("Disabling PyTorch because PyTorch >= 2.6 is required"), so on an
# older base image (the default pytorch/pytorch:2.4.0) pip's newest transformers would import but build no model.
# transformers 4.57 is the last line that supports torch 2.1 and newer.
TORCH_FLOORS = [((2, 6), "transformers<5")]


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version such as 2.4.0+cu124."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def constraints_for(torch_version: str) -> list[str]:
    """The constraint lines for an installed torch: the torch pin itself, then any library cap it needs."""
    lines = [f"torch=={torch_version}"]
    lines += [cap for floor, cap in TORCH_FLOORS if release(torch_version) < floor]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--torch-version", help="default: the torch installed in this Python")
    args = parser.parse_args(argv)
    try:
        version = args.torch_version or importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        print("error: torch is not installed in this Python; the base image must bring it", file=sys.stderr)
        return 1
    print("\n".join(constraints_for(version)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
