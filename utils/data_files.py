"""What a data file holds (SQuAD JSON or a JSONL corpus), told from its content without torch: the launchers ask too."""
import json
from pathlib import Path
from typing import Optional

SQUAD = "squad"   # one JSON document, an object with a "data" list: --squad-file
JSONL = "jsonl"   # one {"text": ...} object per line: --dataset-path
EMPTY = "empty"   # nothing but blank space


def _first_line(path: Path) -> Optional[str]:
    """The first line that is not blank ("" when there is none); None when the file is not UTF-8."""
    try:
        with open(path, encoding="utf-8-sig") as handle:  # -sig: a byte order mark (Windows editors) is no error
            for line in handle:
                if line.strip():
                    return line
    except UnicodeDecodeError:
        return None
    return ""


def _is_squad(document) -> bool:
    return isinstance(document, dict) and isinstance(document.get("data"), list)


def _is_text_record(record) -> bool:
    return isinstance(record, dict) and isinstance(record.get("text"), str)


def first_record_is_text(path: Path) -> bool:
    """Whether the file's first non-blank line alone is a {"text": ...} object: the mark of a JSONL corpus."""
    line = _first_line(Path(path))
    try:
        return bool(line) and _is_text_record(json.loads(line))
    except json.JSONDecodeError:
        return False


def is_one_squad_document(path: Path) -> bool:
    """Whether the whole file is one SQuAD JSON document (an object with a "data" list)."""
    try:
        with open(path, encoding="utf-8-sig") as handle:
            return _is_squad(json.load(handle))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


def sniff_data_file(path: Path) -> Optional[str]:
    """SQUAD, JSONL or EMPTY, by what the file holds whatever its name; None when it is none of them (the trainer's
    reader then says what is wrong). A corpus is judged by its first line, so a large one is not read whole."""
    line = _first_line(Path(path))
    if line is None:
        return None
    if not line:
        return EMPTY
    try:
        record = json.loads(line)
    except json.JSONDecodeError:  # a JSON document spread over lines (or no JSON at all)
        return SQUAD if is_one_squad_document(path) else None
    if _is_text_record(record):
        return JSONL
    return SQUAD if _is_squad(record) else None
