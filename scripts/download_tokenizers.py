"""Save the GPT-2 and BERT tokenizers under one folder (the Docker image's /workspace/pretrained_models) for offline runs."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Where the training side looks before the hub (gpt2/train.py, bert/train.py: /workspace/pretrained_models/<model-name>).
DEFAULT_OUTPUT_DIR = Path("/workspace/pretrained_models")
DEFAULT_MODELS = ("gpt2", "bert-base-uncased")


def save_tokenizer(source: str, output_dir: Path) -> Path:
    """Load a tokenizer (hub name or local folder) and save it to output_dir/<name>, whole or not at all.

    Args:
        source: a hub name such as "gpt2", or a local folder holding a tokenizer.
        output_dir: parent folder; the tokenizer lands in output_dir/<last part of source>.
    """
    from transformers import AutoTokenizer  # imported here so --help works without transformers

    tokenizer = AutoTokenizer.from_pretrained(source)
    output_dir.mkdir(parents=True, exist_ok=True)
    target = output_dir / Path(source.rstrip("/")).name
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=output_dir))
    try:
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR,
                        help=f"parent folder of the saved tokenizers (default: {DEFAULT_OUTPUT_DIR})")
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS),
                        help="hub names or local tokenizer folders (default: %(default)s)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when a tokenizer cannot be saved (default: warn and exit 0, so an offline "
                             "Docker build still succeeds and the training side falls back at run time)")
    args = parser.parse_args(argv)

    failed = 0
    for source in args.models:
        try:
            target = save_tokenizer(source, args.output_dir)
        except Exception as error:  # any hub, network or file error: the build goes on without this tokenizer
            failed += 1
            print(f"warning: could not save the {source} tokenizer ({one_line(error)}); training will load it "
                  f"from the hub at run time, else train a local one", file=sys.stderr)
        else:
            print(f"✓ {source} tokenizer saved to {target}")
    if failed and args.strict:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
