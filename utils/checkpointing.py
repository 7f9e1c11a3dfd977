"""Checkpoints: written atomically, one run per --save-dir (a lock), and checked before --resume-from trusts one."""
import datetime
import errno
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import socket
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from trace_tools.atomic import process_is_alive
from utils.errors import CheckpointError, UsageError
from utils.families import FAMILIES

try:
    import fcntl
except ImportError:  # Windows: the lock then relies on the pid check alone
    fcntl = None

logger = logging.getLogger(__name__)

TRAINING_INFO_FILE = "training_info.json"
TRAINER_STATE_FILE = "trainer_state.pt"  # optimizer, scheduler, grad scaler, data position, counters
RNG_STATE_FILE = "rng_state.pt"          # one entry per rank
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"  # save_pretrained shards large models
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")  # any one makes a loadable tokenizer
LOCK_FILE = ".training.lock"

INITIAL_MODEL = "initial_model"
BEST_MODEL = "best_model"
FINAL_MODEL = "final_model"
# Hidden folders of a checkpoint being written (tmp) or being replaced (old), named with the writer's pid.
PARTIAL_CHECKPOINT = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")
NEARLY_FULL_BYTES = 64 * 2**20

# rng_state.pt of earlier versions held NumPy's random state as an array. These globals only rebuild an array;
# torch documents allowing them for weights_only loading. Anything else in a .pt file is refused.
_NUMPY_ARRAY_GLOBALS = {"numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
                        "numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType"}


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP and torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes: equal on all DDP ranks, and between a resumed and an uninterrupted run."""
    digest = hashlib.sha256()
    for name, tensor in unwrap_model(model).state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---- random state -----------------------------------------------------------------------------------------------
def capture_rng_state(device: torch.device) -> dict:
    """This rank's random streams in types torch.load(weights_only=True) accepts (NumPy's key array as a tensor)."""
    kind, key, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (kind, torch.from_numpy(key.astype(np.int64)), int(position), int(has_gauss),
                       float(cached_gaussian)),
             "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    kind, key, *rest = state["numpy"]
    if isinstance(key, torch.Tensor):
        key = key.numpy().astype(np.uint32)
    np.random.set_state((kind, key, *rest))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ---- writing ------------------------------------------------------------------------------------------------------
def _json_safe(value):
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def describe_write_failure(folder: Path, exc: BaseException) -> str:
    """Why a write failed, in words: a full disk says so with the space left (torch.save reports a full disk
    only as 'unexpected pos', safetensors as 'os error 28')."""
    text = (str(exc).splitlines() or [""])[0].strip() or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    full = (getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in text or "os error 28" in text
            or (free is not None and free < NEARLY_FULL_BYTES))
    if full:
        return "the disk is full" + (f" ({free / 2**20:.1f} MB free)" if free is not None else "")
    return text


def write_checkpoint(target: Path, *, model: torch.nn.Module, tokenizer, info: dict,
                     trainer_state: Optional[dict], rng_states: Optional[list]) -> Path:
    """Write a checkpoint into a hidden temporary folder, then rename it into place (rank 0 only).

    A crash mid-write leaves only the temporary folder, never a half checkpoint under the real name; replacing an
    existing checkpoint (best_model/) moves the old one aside first, so one of the two is always whole. A failed
    write (a full disk) removes its temporary folder and raises CheckpointError saying why.
    """
    target = Path(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        unwrap_model(model).save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if trainer_state is not None:
            torch.save(trainer_state, tmp / TRAINER_STATE_FILE)
        if rng_states is not None:
            torch.save(rng_states, tmp / RNG_STATE_FILE)
        (tmp / TRAINING_INFO_FILE).write_text(json.dumps(_json_safe(info), indent=2) + "\n", encoding="utf-8")
        _publish(tmp, target)
    except Exception as exc:  # OSError, safetensors' SafetensorError and torch.save's RuntimeError alike
        reason = describe_write_failure(target.parent, exc)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{target}: could not write the checkpoint: {reason}") from exc
    return target


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished temporary folder into place; an existing target is moved aside first and moved back if
    the second rename fails (a process killed in between leaves it aside: clean_partial_checkpoints restores it)."""
    if not target.exists():
        os.rename(tmp, target)
        return
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except OSError:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)



def clean_partial_checkpoints(save_dir: Path) -> "list[str]":
    """Remove the hidden half-written folders that dead processes left in save_dir; a replaced checkpoint that was
    only moved aside (killed between the two renames of `_publish`) is moved back. Returns what was done."""
    done = []
    if not Path(save_dir).is_dir():
        return done
    for entry in sorted(Path(save_dir).iterdir()):
        match = PARTIAL_CHECKPOINT.match(entry.name)
        if not match or process_is_alive(int(match["pid"])):
            continue
        original = entry.parent / match["name"]
        try:
            if match["kind"] == "old" and not original.exists():
                os.rename(entry, original)
                done.append(f"restored {original.name}/ from {entry.name}/")
            else:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                done.append(f"removed {entry.name}")
        except OSError as exc:
            logger.warning("%s: could not clean it up (%s)", entry, exc.strerror or exc)
    return done


# ---- output folders ---------------------------------------------------------------------------------------------
def check_writable_folder(folder: Path, flag: str) -> None:
    """Create the folder if needed and write a probe file in it, so a read-only, misnamed or full-of-files path
    fails before the first step instead of at the first save."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} {folder}: is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {folder}: cannot write there ({exc.strerror or exc})") from None


def earlier_checkpoints(save_dir: Path) -> "list[str]":
    """Checkpoint folders of earlier runs in save_dir, newest step last."""
    if not Path(save_dir).is_dir():
        return []
    names = [p.name for p in Path(save_dir).iterdir() if p.is_dir() and not p.name.startswith(".")
             and (p.name in (INITIAL_MODEL, BEST_MODEL, FINAL_MODEL) or re.fullmatch(r"checkpoint-\d+", p.name))]
    return sorted(names, key=lambda n: (n.startswith("checkpoint-"), int(n.split("-")[1]) if "-" in n else 0, n))


def saved_step(checkpoint: Path) -> Optional[int]:
    """The step a checkpoint folder was saved at (checkpoint-N by its name, the others by training_info.json);
    None when that cannot be read."""
    checkpoint = Path(checkpoint)
    match = re.fullmatch(r"checkpoint-(\d+)", checkpoint.name)
    if match:
        return int(match[1])
    try:
        step = read_training_info(checkpoint).get("step")
    except CheckpointError:
        return None
    return step if isinstance(step, int) else None


def later_checkpoints(save_dir: Path, step: int) -> "dict[str, Optional[int]]":
    """{name: step} of the checkpoint folders in save_dir saved after `step` (step None: unreadable, so perhaps
    later): what a run resumed at `step` from one of them would write over."""
    later = {}
    for name in earlier_checkpoints(save_dir):
        saved = 0 if name == INITIAL_MODEL else saved_step(Path(save_dir) / name)
        if saved is None or saved > step:
            later[name] = saved
    return later


class SaveDirLock:
    """One run at a time in a --save-dir: an exclusive flock on save_dir/.training.lock, which records the holder's
    pid, host and command for the refusal message. The kernel drops the flock when the holder dies, so the lock
    of a killed run is taken over (with a warning); without flock support the holder's pid is checked instead.
    """

    LOCK_NAME = LOCK_FILE
    FOLDER = "--save-dir {folder}"                # the folder, as the refusal names it
    ACTIVITY = "is writing checkpoints there"     # what the holder does in it
    CHOICES = "another --save-dir"               # what else this run could use

    def __init__(self, save_dir: Path):
        self.save_dir = Path(save_dir)
        self.path = self.save_dir / self.LOCK_NAME
        self._fd: Optional[int] = None

    def acquire(self) -> Optional[dict]:
        """Take the lock; returns the record of a dead holder whose lock was taken over (None if there was none).
        Raises UsageError when another live run holds it."""
        self.save_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                locked = self._flock(fd)
                previous = self._read(fd)
                if locked is False or (locked is None and previous and self._holder_alive(previous)):
                    raise UsageError(self._refusal(previous, held_for_sure=locked is False))
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            except BaseException:
                os.close(fd)
                raise
            if not same_file:  # the holder released (unlinked) the file between our open and flock: try again
                os.close(fd)
                continue
            record = {"pid": os.getpid(), "host": socket.gethostname(),
                      "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                      "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:500]}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            self._fd = fd
            return previous
        raise UsageError(f"{self.FOLDER.format(folder=self.save_dir)}: could not take the lock {self.path}")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(self._fd)  # drops the flock
        self._fd = None

    def __enter__(self) -> "SaveDirLock":
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False

    @staticmethod
    def _flock(fd: int) -> Optional[bool]:
        """True: locked; False: another process holds it; None: no flock here (the holder's pid decides)."""
        if fcntl is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError:  # a file system without flock (some network mounts)
            return None

    @staticmethod
    def _read(fd: int) -> Optional[dict]:
        try:
            record = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "null")
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    @staticmethod
    def _holder_alive(record: dict) -> bool:
        if record.get("host") != socket.gethostname():
            return True  # cannot tell from here
        return isinstance(record.get("pid"), int) and process_is_alive(record["pid"])

    def _refusal(self, holder: Optional[dict], held_for_sure: bool) -> str:
        who = "another run"
        if holder:
            who = f"another run (pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')})"
        # Without flock a holder on another machine cannot be checked: it may be long gone.
        gone = "" if held_for_sure else "; if that run is gone, delete the lock file"
        return (f"{self.FOLDER.format(folder=self.save_dir)}: {who} {self.ACTIVITY}; wait for it to finish or choose "
                f"{self.CHOICES} (lock file {self.path}{gone})")


# ---- reading ------------------------------------------------------------------------------------------------------
def read_training_info(checkpoint: Path) -> dict:
    path = Path(checkpoint) / TRAINING_INFO_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({getattr(exc, 'msg', exc)}"
                              f"{f', line {exc.lineno}' if hasattr(exc, 'lineno') else ''})") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return info


def _read_config(checkpoint: Path) -> dict:
    path = checkpoint / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint}: not a resumable checkpoint (config.json missing)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({getattr(exc, 'msg', exc)}"
                              f"{f', line {exc.lineno}' if hasattr(exc, 'lineno') else ''}); the checkpoint is "
                              "damaged: resume from another one") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object; the checkpoint is damaged: resume from another one")
    return config


def _check_weights(checkpoint: Path) -> None:
    """model.safetensors (or the shards its index names) present and complete: safetensors checks that the header
    parses and that the file covers every tensor it lists, without reading the tensors."""
    from safetensors import safe_open
    index = checkpoint / WEIGHTS_INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index}: not a valid weights index; the checkpoint is damaged") from None
        files = [checkpoint / name for name in shards]
    else:
        files = [checkpoint / WEIGHTS_FILE]
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{path}: missing: the checkpoint has no model weights; resume from another one")
        if path.stat().st_size == 0:
            raise CheckpointError(f"{path}: empty (0 bytes): the save was cut off; resume from another checkpoint")
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise CheckpointError(f"{path}: damaged or cut off ({str(exc).splitlines()[0]}); resume from another "
                                  "checkpoint") from None


def _check_torch_file(path: Path) -> None:
    """A torch.save file is a zip archive whose directory sits at its end: a cut-off file has none."""
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: empty (0 bytes): the save was cut off; resume from another checkpoint")
    try:
        with zipfile.ZipFile(path):
            pass
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointError(f"{path}: damaged or cut off ({exc}); resume from another checkpoint") from None


def check_resumable(checkpoint: Path, model_type: Optional[str] = None, script: str = "",
                    needs_tokenizer: bool = True) -> None:
    """Everything --resume-from needs, checked before any process group or data: the folder, a config of this
    script's model type, complete weights, the trainer state, training_info.json and (unless --tokenizer-path is
    given) the tokenizer. Reads only headers, so it costs milliseconds even for large checkpoints."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint}: no such checkpoint directory (--resume-from)")
    config = _read_config(checkpoint)
    saved_type = config.get("model_type")
    if model_type and saved_type is None:  # it had said "a None checkpoint"
        raise CheckpointError(f"{checkpoint}/config.json: has no model_type, so it is no checkpoint "
                              f"{script or 'this script'} saved; resume from one it saved")
    if model_type and saved_type != model_type:
        other = f"; resume it with {FAMILIES[saved_type].train_script}" if saved_type in FAMILIES else ""
        raise CheckpointError(f"{checkpoint}/config.json: a {saved_type!r} checkpoint, but {script or 'this script'} "
                              f"trains {model_type!r} models{other}")
    for name in (TRAINER_STATE_FILE, TRAINING_INFO_FILE):
        if not (checkpoint / name).is_file():
            raise CheckpointError(f"{checkpoint}: not a resumable checkpoint ({name} missing)")
    read_training_info(checkpoint)
    _check_weights(checkpoint)
    for name in (TRAINER_STATE_FILE, RNG_STATE_FILE):
        if (checkpoint / name).is_file():
            _check_torch_file(checkpoint / name)
    if needs_tokenizer and not any((checkpoint / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{checkpoint}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass --tokenizer-path "
                              "with the tokenizer this model was trained with")


def load_plain_torch_file(path: Path):
    """torch.load with weights_only=True: tensors, numbers, strings and containers only, so a planted object (whose
    unpickling would run code) is refused before anything runs. rng_state.pt of earlier versions also holds NumPy
    arrays, which are allowed."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        unsafe = _unsafe_globals(path)
        if unsafe is not None and unsafe and unsafe <= _NUMPY_ARRAY_GLOBALS:
            with torch.serialization.safe_globals(_numpy_array_globals()):
                return torch.load(path, map_location="cpu", weights_only=True)
        if unsafe is None:
            raise CheckpointError(f"{path}: damaged or cut off (not a readable torch file); resume from another "
                                  "checkpoint") from None
        raise CheckpointError(f"{path}: refused: it holds Python objects ({', '.join(sorted(unsafe)) or 'unknown'}) "
                              "that loading would run as code; resume only from checkpoints written by this trainer "
                              "that you trust") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path}: damaged or cut off ({(str(exc).splitlines() or [type(exc).__name__])[0]}); "
                              "resume from another checkpoint") from None


def _unsafe_globals(path: Path) -> Optional[set]:
    """The globals a pickle would call, found without unpickling; None when the file cannot be read as one."""
    finder = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if finder is None:  # torch < 2.5: cannot tell a legacy NumPy array from anything else
        return {"objects other than tensors and plain values"}
    try:
        return set(finder(str(path)))
    except Exception:
        return None


def _numpy_array_globals() -> list:
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_resume_state(checkpoint: Path) -> "tuple[dict, Optional[list]]":
    """(trainer_state, rng_states), loaded as plain data (see load_plain_torch_file) and checked for the keys the
    trainer reads."""
    checkpoint = Path(checkpoint)
    state_file = checkpoint / TRAINER_STATE_FILE
    trainer_state = load_plain_torch_file(state_file)
    required = ("step", "data", "optimizer", "scheduler", "scaler", "tokens_seen", "elapsed_seconds")
    missing = [key for key in required if not isinstance(trainer_state, dict) or key not in trainer_state]
    if missing:
        raise CheckpointError(f"{state_file}: not this trainer's state (missing {', '.join(missing)}); resume from "
                              "another checkpoint")
    rng_file = checkpoint / RNG_STATE_FILE
    rng_states = load_plain_torch_file(rng_file) if rng_file.is_file() else None
    if rng_states is not None and not (isinstance(rng_states, list) and all(isinstance(s, dict) for s in rng_states)):
        raise CheckpointError(f"{rng_file}: not this trainer's random state; resume from another checkpoint")
    return trainer_state, rng_states
