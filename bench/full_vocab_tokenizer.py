"""The tokenizer our trainer would pick, padded with unused tokens to the model's own vocabulary size, for benchmarks.

Offline, the trainer trains a stand-in tokenizer on the bundled SQuAD sample: about 1,400 tokens where GPT-2 has
50,257, which shrinks "GPT-2 124M" to 86M parameters (the embedding and the output projection are a third of the
model). Padding the stand-in with tokens that never occur in the text restores the published shapes, so the
benchmarks time and trace the real model; tokenization of the data is unchanged.
"""
import os
import shutil
import sys
from pathlib import Path

from bench.common import BUNDLED_SQUAD, REPO_ROOT
from trace_tools.command_line import ArgumentParser
from utils.families import FAMILIES, load_family

DEFAULT_CACHE = REPO_ROOT / "bench" / ".cache" / "tokenizers"
UNUSED_TOKEN = "<|bench_unused_{}|>"


def full_vocab_tokenizer(family_name: str, model_name: str,
                         cache_root: Path = DEFAULT_CACHE) -> "tuple[Path, int, int]":
    """(tokenizer directory, tokens before padding, vocabulary size of the model); made once, then cached."""
    from utils.data_utils import load_text_splits
    from utils.tokenization import load_tokenizer

    family = load_family(family_name)
    config = family.resolve_config(model_name)
    target = config.vocab_size
    splits = load_text_splits(squad_file=str(BUNDLED_SQUAD), dataset_path=None, cache_dir=None,
                              validation_fraction=0.1, seed=42)
    request = family.tokenizer_request(model_name, config)
    tokenizer, source = load_tokenizer(request, tokenizer_path=None, cache_dir=None, training_texts=splits.all_texts)
    before = len(tokenizer)
    slug = source.replace(":", "_").replace("/", "_")
    folder = Path(cache_root) / f"{family_name}-{model_name}-{slug}-{before}-to-{max(before, target)}"
    if (folder / "tokenizer_config.json").is_file():
        return folder, before, target
    if before < target:
        tokenizer.add_tokens([UNUSED_TOKEN.format(i) for i in range(target - before)])
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = folder.with_name(f".{folder.name}.{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer.save_pretrained(str(partial))
    try:
        os.rename(partial, folder)
    except OSError:  # made by another run meanwhile
        shutil.rmtree(partial, ignore_errors=True)
    return folder, before, target


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(FAMILIES), required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    args = parser.parse_args(argv)
    from utils.errors import UsageError
    try:
        folder, before, target = full_vocab_tokenizer(args.model, args.model_name, Path(args.cache_dir))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{before} {target} {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
