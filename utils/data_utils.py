"""Training text (SQuAD from the hub, a SQuAD JSON file, a JSONL corpus or the bundled sample), tokenized and batched."""
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from utils.data_files import first_record_is_text, is_one_squad_document
from utils.errors import DataError
from utils.hub import hub_is_offline

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_SQUAD_SAMPLE = REPO_ROOT / "data" / "squad_sample.json"
HUB_SQUAD_ID = "rajpurkar/squad"
TOKENIZE_CHUNK = 2000  # examples per tokenizer call: fast, and keeps peak memory low on full SQuAD
# Batch key of the number of real (non-padding) tokens in the batch, for tokens/s and MFU; not a model input.
REAL_TOKENS = "num_real_tokens"


@dataclass(frozen=True)
class TextExample:
    """One training example: a SQuAD (question, context) pair, or a corpus line (text, None)."""

    text: str
    text_pair: Optional[str] = None


@dataclass
class TextSplits:
    train: List[TextExample]
    validation: List[TextExample]
    source: str  # for logs and training_info.json

    def all_texts(self) -> Iterator[str]:
        """Every distinct string in the training split (SQuAD repeats each context per question)."""
        seen = {}
        for example in self.train:
            seen.setdefault(example.text, None)
            if example.text_pair is not None:
                seen.setdefault(example.text_pair, None)
        return iter(seen)


# --------------------------------------------------------------------------------------------------- readers
def read_squad_json(path: Path) -> List[TextExample]:
    """(question, context) for every question of a SQuAD v1.1 or v2.0 file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found" if not path.exists() else f"{path}: not a file")
    try:
        with open(path, encoding="utf-8-sig") as handle:  # -sig: a byte order mark (Windows editors) is no error
            document = json.load(handle)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and first_record_is_text(path):
            raise DataError(f"{path}: a JSONL corpus (one {{\"text\": ...}} object per line), not SQuAD JSON; "
                            "pass it with --dataset-path") from None
        raise DataError(f"{path}: {json_problem(exc)}") from None
    if isinstance(document, dict) and isinstance(document.get("text"), str) and "data" not in document:
        raise DataError(f"{path}: a JSONL corpus (one {{\"text\": ...}} object per line), not SQuAD JSON; "
                        "pass it with --dataset-path")
    if not isinstance(document, dict) or not isinstance(document.get("data"), list):
        raise DataError(f"{path}: not SQuAD v1.1/v2.0 JSON (expected an object with a \"data\" list)")
    examples = []
    for a, article in enumerate(document["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise DataError(f"{path}: data[{a}] has no \"paragraphs\" list")
        for p, paragraph in enumerate(paragraphs):
            where = f"data[{a}].paragraphs[{p}]"
            if not isinstance(paragraph, dict) or not isinstance(paragraph.get("context"), str):
                raise DataError(f"{path}: {where} has no \"context\" string")
            qas = paragraph.get("qas")
            if not isinstance(qas, list):
                raise DataError(f"{path}: {where} has no \"qas\" list")
            for q, qa in enumerate(qas):
                if not isinstance(qa, dict) or not isinstance(qa.get("question"), str):
                    raise DataError(f"{path}: {where}.qas[{q}] has no \"question\" string")
                examples.append(TextExample(qa["question"].strip(), paragraph["context"].strip()))
    if not examples:
        raise DataError(f"{path}: no questions found")
    return examples


def json_problem(exc: json.JSONDecodeError) -> str:
    """What is wrong with a JSON file, for an error line: where it breaks, or that it ends early (cut short)."""
    if not exc.doc.strip():
        return "an empty file, not JSON"
    # The decoder stops at the end of the text, or reports a string that the end of the text left open.
    if not exc.doc[exc.pos:].strip() or exc.msg.startswith("Unterminated string"):
        line, column = exc.doc.count("\n") + 1, len(exc.doc) - exc.doc.rfind("\n")
        return f"not valid JSON: it ends at line {line}, column {column} before the JSON does (cut short?)"
    return f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"


def _jsonl_files(path: Path) -> List[Path]:
    if path.is_dir():
        files = sorted(file for file in path.glob("*.jsonl") if file.is_file())
        if not files:
            raise DataError(f"{path}: directory has no *.jsonl files")
        return files
    if not path.exists():
        raise DataError(f"{path}: file not found")
    return [path]


def read_jsonl_corpus(path: Path) -> List[TextExample]:
    """One example per {"text": ...} line of a JSONL file (or of every *.jsonl in a directory); blank lines skipped."""
    examples = []
    for file in _jsonl_files(Path(path)):
        with open(file, "rb") as handle:
            first_record = True
            for number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte order mark is no error
                except UnicodeDecodeError as exc:
                    raise DataError(f"{file}:{number}: not UTF-8 ({exc.reason} at byte {exc.start} of the line)") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    problem = f"not valid JSON ({exc.msg} at column {exc.colno})"
                else:
                    is_text_record = isinstance(record, dict) and isinstance(record.get("text"), str)
                    problem = None if is_text_record else "expected an object with a \"text\" string"
                if problem:
                    # A SQuAD file given as a corpus fails on its first line: say what it is, not where it broke.
                    if first_record and is_one_squad_document(file):
                        raise DataError(f"{file}: a SQuAD JSON file, not a JSONL corpus of {{\"text\": ...}} lines; "
                                        "pass it with --squad-file")
                    raise DataError(f"{file}:{number}: {problem}")
                first_record = False
                if record["text"].strip():
                    examples.append(TextExample(record["text"].strip()))
    if not examples:
        raise DataError(f"{path}: no non-empty \"text\" lines")
    return examples


def load_hub_squad(cache_dir: Optional[str]) -> "tuple[Optional[TextSplits], str]":
    """SQuAD v1.1 through `datasets` (honours --cache-dir); (None, reason) when it cannot be had."""
    offline = hub_is_offline()  # switches the libraries to cache-only before `datasets` reads its config
    try:
        import datasets
        datasets.disable_progress_bars()
        squad = datasets.load_dataset(HUB_SQUAD_ID, cache_dir=cache_dir)
    except Exception as exc:  # any failure (no network, no cache, old datasets) means: use local data
        reason = "offline and not in the cache" if offline else f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return None, reason

    def pairs(split):
        return [TextExample(q.strip(), c.strip()) for q, c in zip(split["question"], split["context"])]

    return TextSplits(pairs(squad["train"]), pairs(squad["validation"]), f"hub:{HUB_SQUAD_ID}"), ""


def split_train_validation(examples: Sequence[TextExample], fraction: float, seed: int,
                           source: str = "the data") -> "tuple[list, list]":
    """Hold out a seeded random fraction (at least one example) for validation; `source` names the data in errors."""
    if len(examples) < 2:
        raise DataError(f"{source}: need at least 2 examples to hold out a validation set, got {len(examples)}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_val = min(len(examples) - 1, max(1, round(len(examples) * fraction)))
    validation = [examples[i] for i in sorted(order[:n_val])]
    train = [examples[i] for i in sorted(order[n_val:])]
    return train, validation


def load_text_splits(*, squad_file: Optional[str], dataset_path: Optional[str], cache_dir: Optional[str],
                     validation_fraction: float, seed: int, allow_hub: bool = True) -> TextSplits:
    """The training text, from the first of: --dataset-path, --squad-file, the hub's SQuAD, the bundled sample."""
    if dataset_path:
        train, val = split_train_validation(read_jsonl_corpus(Path(dataset_path)), validation_fraction, seed,
                                            source=str(dataset_path))
        return TextSplits(train, val, f"jsonl:{dataset_path}")
    if squad_file:
        train, val = split_train_validation(read_squad_json(Path(squad_file)), validation_fraction, seed,
                                            source=str(squad_file))
        return TextSplits(train, val, f"squad-file:{squad_file}")
    reason = "not tried"
    if allow_hub:
        splits, reason = load_hub_squad(cache_dir)
        if splits is not None:
            return splits
    bundled = read_squad_json(BUNDLED_SQUAD_SAMPLE)
    logger.warning("SQuAD from the Hugging Face hub is not available (%s); training on the bundled sample %s "
                   "(%d generated questions). Pass --squad-file or --dataset-path to use your own data.",
                   reason, BUNDLED_SQUAD_SAMPLE.relative_to(REPO_ROOT), len(bundled))
    train, val = split_train_validation(bundled, validation_fraction, seed)
    return TextSplits(train, val, f"bundled:{BUNDLED_SQUAD_SAMPLE.relative_to(REPO_ROOT)}")


def check_data_flags(squad_file: Optional[str], dataset_path: Optional[str]) -> None:
    """Fail before any process group or model exists when a named data file is missing."""
    if squad_file and dataset_path:
        raise DataError("--squad-file and --dataset-path are alternatives; pass one")
    if squad_file and Path(squad_file).is_dir():
        raise DataError(f"{squad_file}: a directory, not a SQuAD JSON file (--squad-file; a directory of *.jsonl "
                        "files goes to --dataset-path)")
    if squad_file and not Path(squad_file).is_file():
        raise DataError(f"{squad_file}: file not found (--squad-file)")
    if dataset_path and not Path(dataset_path).exists():
        raise DataError(f"{dataset_path}: file not found (--dataset-path)")


# ------------------------------------------------------------------------------------------- tokenized data
class PackedExamples(Dataset):
    """Tokenized, unpadded examples in flat int32 arrays (full SQuAD as Python lists would take ~0.5 GB per rank).

    Items are dicts of lists, ready for a transformers data collator; attention_mask is all ones before padding.
    """

    def __init__(self, columns: dict, offsets: np.ndarray):
        self.columns = columns
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> dict:
        start, end = self.offsets[index], self.offsets[index + 1]
        item = {name: values[start:end].tolist() for name, values in self.columns.items()}
        item["attention_mask"] = [1] * (end - start)
        return item

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])


def tokenize_examples(encode: Callable[[List[TextExample]], dict], examples: Sequence[TextExample],
                      min_tokens: int = 2) -> PackedExamples:
    """Run a family's `encode` (tokenizer call with truncation/overflow) in chunks and pack the results.

    Sequences shorter than min_tokens (a one-token overflow tail) are dropped: they hold no prediction target.
    """
    pieces, lengths = {}, []
    for start in range(0, len(examples), TOKENIZE_CHUNK):
        encoded = encode(list(examples[start:start + TOKENIZE_CHUNK]))
        keep = [i for i, row in enumerate(encoded["input_ids"]) if len(row) >= min_tokens]
        for name, rows in encoded.items():
            if name in ("attention_mask", "overflow_to_sample_mapping"):
                continue
            pieces.setdefault(name, []).extend(np.asarray(rows[i], dtype=np.int32) for i in keep)
        lengths.extend(len(encoded["input_ids"][i]) for i in keep)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    columns = {name: (np.concatenate(rows) if rows else np.zeros(0, np.int32)) for name, rows in pieces.items()}
    return PackedExamples(columns, offsets)


def group_texts(token_rows: Sequence[Sequence[int]], block_size: int, separator: Optional[int] = None) -> List[List[int]]:
    """Concatenate tokenized texts (each followed by `separator`, e.g. GPT-2's end-of-text) and cut the stream into
    full blocks of block_size tokens, dropping the remainder: transformers' run_clm `group_texts`, applied to one
    chunk of examples at a time as run_clm applies it per map batch. Every token of every block is a real one, so
    no padding is trained, traced or counted, and causal attention needs no mask."""
    stream: List[int] = []
    for row in token_rows:
        stream.extend(row)
        if separator is not None:
            stream.append(separator)
    usable = len(stream) - len(stream) % block_size
    return [stream[start:start + block_size] for start in range(0, usable, block_size)]


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start mid-epoch, so a resumed run sees exactly the batches it had left.

    The order depends only on (seed, epoch, rank, world size); skipping indices here instead of drawing and
    dropping batches keeps the collator's random masking in step with the saved RNG state.
    """

    def __init__(self, dataset, *, num_replicas: int, rank: int, shuffle: bool, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.start_index = 0

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.start_index:])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start_index)


class CountingCollator:
    """A collator that also records in the batch how many tokens its examples held before padding (REAL_TOKENS).

    Counted from the examples' Python lists, not the collated mask: no torch op lands in the traced step and no
    device sync is needed to read it.
    """

    def __init__(self, collate_fn: Callable):
        self.collate_fn = collate_fn

    def __call__(self, features: List[dict]) -> dict:
        batch = self.collate_fn(features)
        batch[REAL_TOKENS] = sum(len(feature["input_ids"]) for feature in features)
        return batch


def build_dataloader(dataset: Dataset, collate_fn, *, batch_size: int, rank: int, world_size: int, seed: int,
                     train: bool, pin_memory: bool, num_workers: int = 0) -> DataLoader:
    """Batches of this rank's share. num_workers > 0 only for collators that draw no random numbers: workers would
    run the MLM collator on their own RNG streams, which a resume could not restore."""
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=train, seed=seed)
    # The explicit generator keeps DataLoader iterators from drawing on the global RNG the collator uses.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=CountingCollator(collate_fn),
                      drop_last=train,
                      num_workers=num_workers, persistent_workers=num_workers > 0, pin_memory=pin_memory,
                      generator=torch.Generator().manual_seed(seed))


class BatchStream:
    """Endless batches over epochs that remembers (epoch, batches taken this epoch) for checkpoints."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.sampler: ResumableDistributedSampler = loader.sampler
        self.batch_size = loader.batch_size
        self.batches_per_epoch = len(loader)
        self.epoch = 0
        self.position = 0
        self._iterator = None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._iterator is None:
            self._start_epoch(self.position)
        try:
            batch = next(self._iterator)
        except StopIteration:
            self.epoch += 1
            self._start_epoch(0)
            batch = next(self._iterator)
        self.position += 1
        return batch

    def _start_epoch(self, position: int) -> None:
        self.position = position
        self.sampler.set_epoch(self.epoch)
        self.sampler.start_index = position * self.batch_size
        self._iterator = iter(self.loader)

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.position / max(1, self.batches_per_epoch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "batch_size": self.batch_size,
                "batches_per_epoch": self.batches_per_epoch}

    def load_state_dict(self, state: dict) -> bool:
        """Continue where the saved run stopped; False (start of that epoch) when the batching differs."""
        self.epoch = int(state["epoch"])
        same_batching = (state.get("batch_size") == self.batch_size
                         and state.get("batches_per_epoch") == self.batches_per_epoch)
        self.position = int(state["position"]) if same_batching else 0
        self._iterator = None
        return same_batching


class RepeatedBatch:
    """--overfit-one-batch: the same collated batch forever (a model that cannot fit it has a bug)."""

    def __init__(self, loader: DataLoader):
        self.batch = next(iter(loader))
        self.epoch, self.position, self.batches_per_epoch = 0, 0, 1

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        self.position += 1
        return self.batch

    @property
    def epochs_done(self) -> float:
        return float(self.position)

    def state_dict(self) -> dict:
        return {"epoch": 0, "position": self.position, "overfit_one_batch": True}

    def load_state_dict(self, state: dict) -> bool:
        self.position = int(state.get("position", 0))
        return True
