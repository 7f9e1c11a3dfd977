"""Tokenizers: --tokenizer-path, /workspace/pretrained_models/<model>, the hub, else one trained on the training text."""
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from trace_tools.atomic import process_is_alive
from utils.data_utils import json_problem
from utils.errors import UsageError
from utils.hub import hub_is_offline

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
PRETRAINED_MODELS_DIR = Path("/workspace/pretrained_models")  # where the Docker image puts downloaded tokenizers
TRAINED_TOKENIZER_CACHE = REPO_ROOT / "data" / "tokenizers"  # git-ignored

GPT2_SPECIAL = "<|endoftext|>"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# The special tokens a family's training uses, by the kind of tokenizer it asks for: GPT-2 ends every packed text
# with end-of-text (gpt2/train.py); masked-LM replaces tokens with [MASK] and pads batches (bert/train.py). Without
# them BERT fails deep in its collator, and GPT-2 silently trains on texts run together.
REQUIRED_SPECIAL_TOKENS = {"byte-level-bpe": ("eos_token",), "wordpiece": ("mask_token", "pad_token")}
# Files a saved tokenizer reads: JSON ones (a damaged one is named in the error) and those holding the vocabulary.
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "vocab.json", "config.json")
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "merges.txt", "*.model", "*.tiktoken")


@dataclass(frozen=True)
class TokenizerRequest:
    """What a family needs: where to look, and how to train a stand-in of the same kind."""

    family: str                   # "gpt2" or "bert": cache folder prefix
    kind: str                     # "byte-level-bpe" or "wordpiece"
    model_name: str               # --model-name (a size name or a directory)
    hub_id: Optional[str]         # published tokenizer for this model, None for `tiny`
    vocab_size: int               # target size for a trained stand-in
    lowercase: bool = False       # wordpiece only (the *-uncased models)
    shared_name: Optional[str] = None  # sizes share one tokenizer: gpt2-xl also takes pretrained_models/gpt2


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int):
    """A GPT-2 style tokenizer: byte-level BPE with <|endoftext|> as bos/eos/unk (and pad, as GPT-2 has none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GPT2TokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[GPT2_SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return GPT2TokenizerFast(tokenizer_object=tokenizer, bos_token=GPT2_SPECIAL, eos_token=GPT2_SPECIAL,
                             unk_token=GPT2_SPECIAL, pad_token=GPT2_SPECIAL, clean_up_tokenization_spaces=False)


def train_wordpiece(texts: Iterable[str], vocab_size: int, lowercase: bool):
    """A BERT style tokenizer: WordPiece with [CLS] A [SEP] B [SEP] pairs and token type ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=BERT_SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return BertTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                             cls_token="[CLS]", mask_token="[MASK]", do_lower_case=lowercase,
                             clean_up_tokenization_spaces=True)


def _texts_fingerprint(texts: Iterable[str]) -> "tuple[str, list]":
    digest, kept = hashlib.sha256(), []
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
        kept.append(text)
    return digest.hexdigest()[:12], kept


def tokenizer_dir_problem(directory: Path) -> Optional[str]:
    """What keeps the tokenizer in `directory` from loading, told from its files (a damaged JSON file, no
    vocabulary, half of a BPE pair); None when the files look whole."""
    for name in TOKENIZER_JSON_FILES:
        file = directory / name
        if not file.is_file():
            continue
        try:
            json.loads(file.read_text(encoding="utf-8-sig"))
        except UnicodeDecodeError as exc:
            return f"{name} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        except json.JSONDecodeError as exc:
            return f"{name} is {json_problem(exc)}"
    if not any(next(directory.glob(pattern), None) for pattern in VOCABULARY_FILES):
        return ("no vocabulary files there (tokenizer.json, vocab.json + merges.txt, vocab.txt or a SentencePiece "
                ".model)")
    if not (directory / "tokenizer.json").is_file():
        for have, missing in (("vocab.json", "merges.txt"), ("merges.txt", "vocab.json")):
            if (directory / have).is_file() and not (directory / missing).is_file():
                return f"it has {have} but no {missing}: a BPE tokenizer needs both (or a tokenizer.json)"
    return None


def _load_pretrained(location: str, request: Optional[TokenizerRequest] = None, **kwargs):
    """The tokenizer saved at `location` (a folder or a hub id); ValueError naming the problem when there is none.

    One with no tokens besides its special ones is refused: transformers builds such a tokenizer from a folder that
    holds a model's config.json and no vocabulary files, and it turns every text into nothing (GPT-2) or into [UNK]s
    (BERT). With a `request`, one without the special tokens that family's training uses is refused too.
    """
    from transformers import AutoTokenizer
    folder = Path(location)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    except Exception as exc:  # OSError, ValueError, JSON errors, and the tokenizers library's bare Exception
        problem = tokenizer_dir_problem(folder) if folder.is_dir() else None
        raise ValueError(problem or (str(exc).splitlines() or [type(exc).__name__])[0]) from None
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        problem = tokenizer_dir_problem(folder) if folder.is_dir() else None
        raise ValueError(problem or f"it has no vocabulary, only {len(tokenizer)} special token(s)")
    required = REQUIRED_SPECIAL_TOKENS.get(request.kind, ()) if request else ()
    missing = [attribute for attribute in required if getattr(tokenizer, attribute, None) is None]
    if missing:
        unnamed = folder.is_dir() and not any((folder / name).is_file()
                                              for name in ("tokenizer_config.json", "special_tokens_map.json"))
        why = ("no tokenizer_config.json there says which tokens are special" if unnamed
               else f"not a {request.family} tokenizer?")
        raise ValueError(f"it has no {' and no '.join(missing)}, which {request.family} training needs ({why})")
    return tokenizer


# What trained_tokenizer() writes before its rename: .<cache name>.tmp-<pid>
_PARTIAL_CACHE = re.compile(r"^\..+\.tmp-(?P<pid>\d+)$")


def _remove_partial_caches(cache_root: Path) -> None:
    """Remove the half-written tokenizer folders that killed runs left in the cache (their pid is gone)."""
    if not cache_root.is_dir():
        return
    for entry in cache_root.iterdir():
        match = _PARTIAL_CACHE.match(entry.name)
        if not match or process_is_alive(int(match["pid"])):
            continue
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        logger.info("removed %s (a tokenizer cache left half-written by a stopped run)", entry)


def _cached_tokenizer(cache_dir: Path, request: TokenizerRequest):
    """The tokenizer cached in cache_dir; None when there is none, or when it does not load (a damaged or emptied
    folder), which is then moved out of the way so that a fresh one can take its name."""
    if not cache_dir.exists():
        return None
    try:
        return _load_pretrained(str(cache_dir), request)
    except ValueError as exc:
        logger.warning("%s: the cached tokenizer does not load (%s); training it again", cache_dir, exc)
    aside = cache_dir.with_name(f".{cache_dir.name}.broken.tmp-{os.getpid()}")  # _PARTIAL_CACHE: cleaned if killed
    try:
        os.rename(cache_dir, aside)
    except OSError:  # another run moved it first
        return None
    shutil.rmtree(aside, ignore_errors=True) if aside.is_dir() else aside.unlink(missing_ok=True)
    return None


def trained_tokenizer(request: TokenizerRequest, texts: Iterable[str], cache_root: Optional[Path] = None):
    """Train (or reuse from the cache) a tokenizer of the family's kind on these texts: (tokenizer, cache dir).

    The cache key is the kind, vocabulary size and a hash of the text, so a different dataset gets its own; a
    cached one that does not load is trained again. Call it on rank 0 first (DistributedContext.main_process_first):
    the others then find it cached. cache_root defaults to TRAINED_TOKENIZER_CACHE.
    """
    import tokenizers
    cache_root = Path(cache_root) if cache_root is not None else TRAINED_TOKENIZER_CACHE
    fingerprint, texts = _texts_fingerprint(texts)
    # tokenizer.json's format changes between tokenizers releases (an older one cannot read a newer file).
    version = ".".join(tokenizers.__version__.split(".")[:2])
    cache_dir = cache_root / f"{request.family}-{request.kind}-{request.vocab_size}-{fingerprint}-tok{version}"
    _remove_partial_caches(cache_root)
    cached = _cached_tokenizer(cache_dir, request)
    if cached is not None:
        return cached, cache_dir
    if request.kind == "byte-level-bpe":
        tokenizer = train_byte_level_bpe(texts, request.vocab_size)
    elif request.kind == "wordpiece":
        tokenizer = train_wordpiece(texts, request.vocab_size, request.lowercase)
    else:
        raise ValueError(f"unknown tokenizer kind {request.kind!r}")
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / f".{cache_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(str(tmp))
    try:
        os.rename(tmp, cache_dir)
    except OSError:  # another run cached the same tokenizer meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return _load_pretrained(str(cache_dir), request), cache_dir


def load_tokenizer(request: TokenizerRequest, *, tokenizer_path: Optional[str], cache_dir: Optional[str],
                   training_texts: Callable[[], Iterable[str]]) -> "tuple[object, str]":
    """The first tokenizer found along the chain, and a description of where it came from."""
    if tokenizer_path:
        if not Path(tokenizer_path).exists():
            raise UsageError(f"{tokenizer_path}: not found (--tokenizer-path)")
        if not Path(tokenizer_path).is_dir():
            raise UsageError(f"{tokenizer_path}: a file, not a tokenizer directory (--tokenizer-path takes the folder "
                             "that holds tokenizer.json or the vocabulary files)")
        try:
            return _load_pretrained(tokenizer_path, request), f"--tokenizer-path {tokenizer_path}"
        except ValueError as exc:
            raise UsageError(f"{tokenizer_path}: cannot load a tokenizer ({exc})") from None

    # A model folder's own tokenizer first, then the downloaded one of that name. A model folder has a config.json
    # (utils/model_config.py): `--model-name gpt2` in the repository root names the size, not the gpt2/ sources.
    model_dir = Path(request.model_name)
    candidates = [model_dir] if (model_dir / "config.json").is_file() else []
    candidates.append(PRETRAINED_MODELS_DIR / request.model_name)
    if request.shared_name:
        candidates.append(PRETRAINED_MODELS_DIR / request.shared_name)
    candidates = list(dict.fromkeys(candidates))
    for local in candidates:
        if local.is_dir():
            try:
                return _load_pretrained(str(local), request), str(local)
            except ValueError as exc:
                logger.info("no usable tokenizer in %s (%s)", local, exc)

    tried = [str(local) for local in candidates]
    if request.hub_id:
        offline = hub_is_offline()
        try:
            return (_load_pretrained(request.hub_id, request, cache_dir=cache_dir, local_files_only=offline),
                    f"hub:{request.hub_id}")
        except ValueError as exc:
            tried.append(f"the hub ({request.hub_id}: {'offline, not cached' if offline else exc})")

    tokenizer, location = trained_tokenizer(request, training_texts())
    where = location.relative_to(REPO_ROOT) if location.is_relative_to(REPO_ROOT) else location
    message = (f"no {request.family} tokenizer in {' or '.join(tried)}; using a {request.kind} tokenizer "
               f"(vocabulary {len(tokenizer)}) trained on the training text, cached in {where}")
    if request.hub_id:
        logger.warning("%s. Its token ids differ from the published %s tokenizer; pass --tokenizer-path to use that.",
                       message, request.hub_id)
    else:
        logger.info("%s", message)
    return tokenizer, f"trained:{where}"
