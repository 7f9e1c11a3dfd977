"""Tokenizers: --tokenizer-path, /workspace/pretrained_models/<model>, the hub, else one trained on the training text."""
import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from trace_tools.atomic import process_is_alive
from utils.errors import UsageError
from utils.hub import hub_is_offline

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
PRETRAINED_MODELS_DIR = Path("/workspace/pretrained_models")  # where the Docker image puts downloaded tokenizers
TRAINED_TOKENIZER_CACHE = REPO_ROOT / "data" / "tokenizers"  # git-ignored

GPT2_SPECIAL = "<|endoftext|>"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


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


def _load_pretrained(location: str, **kwargs):
    """The tokenizer saved at `location`. One with no tokens besides its special ones is refused (ValueError):
    transformers builds such a tokenizer from a folder that holds a model's config.json and no vocabulary files,
    and it turns every text into nothing (GPT-2) or into [UNK]s (BERT)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise ValueError(f"it has no vocabulary, only {len(tokenizer)} special token(s): no tokenizer files there")
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



def trained_tokenizer(request: TokenizerRequest, texts: Iterable[str], cache_root: Path = TRAINED_TOKENIZER_CACHE):
    """Train (or reuse from the cache) a tokenizer of the family's kind on these texts: (tokenizer, cache dir).

    The cache key is the kind, vocabulary size and a hash of the text, so a different dataset gets its own.
    Call it on rank 0 first (DistributedContext.main_process_first): the others then find it cached.
    """
    import tokenizers
    fingerprint, texts = _texts_fingerprint(texts)
    # tokenizer.json's format changes between tokenizers releases (an older one cannot read a newer file).
    version = ".".join(tokenizers.__version__.split(".")[:2])
    cache_dir = cache_root / f"{request.family}-{request.kind}-{request.vocab_size}-{fingerprint}-tok{version}"
    _remove_partial_caches(cache_root)
    if not (cache_dir / "tokenizer.json").is_file():
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
    return _load_pretrained(str(cache_dir)), cache_dir


def load_tokenizer(request: TokenizerRequest, *, tokenizer_path: Optional[str], cache_dir: Optional[str],
                   training_texts: Callable[[], Iterable[str]]) -> "tuple[object, str]":
    """The first tokenizer found along the chain, and a description of where it came from."""
    if tokenizer_path:
        if not Path(tokenizer_path).exists():
            raise UsageError(f"{tokenizer_path}: not found (--tokenizer-path)")
        try:
            return _load_pretrained(tokenizer_path), f"--tokenizer-path {tokenizer_path}"
        except (OSError, ValueError) as exc:
            raise UsageError(f"{tokenizer_path}: cannot load a tokenizer ({str(exc).splitlines()[0]})") from None

    model_dir = Path(request.model_name)
    candidates = [model_dir if model_dir.is_dir() else PRETRAINED_MODELS_DIR / request.model_name]
    if request.shared_name and request.shared_name != request.model_name:
        candidates.append(PRETRAINED_MODELS_DIR / request.shared_name)
    for local in candidates:
        if local.is_dir():
            try:
                return _load_pretrained(str(local)), str(local)
            except (OSError, ValueError) as exc:
                logger.info("no usable tokenizer in %s (%s)", local, str(exc).splitlines()[0])

    tried = [str(local) for local in candidates]
    if request.hub_id:
        offline = hub_is_offline()
        try:
            return (_load_pretrained(request.hub_id, cache_dir=cache_dir, local_files_only=offline),
                    f"hub:{request.hub_id}")
        except (OSError, ValueError) as exc:
            tried.append(f"the hub ({request.hub_id}: {'offline, not cached' if offline else str(exc).splitlines()[0]})")

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
