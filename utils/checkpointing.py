"""Checkpoints: `save_pretrained` weights and tokenizer, training_info.json and resume state, each written atomically."""
import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from utils.errors import UsageError

logger = logging.getLogger(__name__)

TRAINING_INFO_FILE = "training_info.json"
TRAINER_STATE_FILE = "trainer_state.pt"  # optimizer, scheduler, grad scaler, data position, counters
RNG_STATE_FILE = "rng_state.pt"          # one entry per rank

INITIAL_MODEL = "initial_model"
BEST_MODEL = "best_model"
FINAL_MODEL = "final_model"


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


def capture_rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _json_safe(value):
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def write_checkpoint(target: Path, *, model: torch.nn.Module, tokenizer, info: dict,
                     trainer_state: Optional[dict], rng_states: Optional[list]) -> Path:
    """Write a checkpoint into a hidden temporary folder, then rename it into place (rank 0 only).

    A crash mid-write leaves only the temporary folder, never a half checkpoint under the real name; replacing an
    existing checkpoint (best_model/) moves the old one aside first, so one of the two is always whole.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    unwrap_model(model).save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    if trainer_state is not None:
        torch.save(trainer_state, tmp / TRAINER_STATE_FILE)
    if rng_states is not None:
        torch.save(rng_states, tmp / RNG_STATE_FILE)
    (tmp / TRAINING_INFO_FILE).write_text(json.dumps(_json_safe(info), indent=2) + "\n", encoding="utf-8")
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
    return target


def read_training_info(checkpoint: Path) -> dict:
    path = Path(checkpoint) / TRAINING_INFO_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{path}: not found") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None


def check_resumable(checkpoint: Path) -> None:
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise UsageError(f"{checkpoint}: no such checkpoint directory (--resume-from)")
    for name in ("config.json", TRAINER_STATE_FILE, TRAINING_INFO_FILE):
        if not (checkpoint / name).is_file():
            raise UsageError(f"{checkpoint}: not a resumable checkpoint ({name} missing)")


def load_resume_state(checkpoint: Path) -> "tuple[dict, Optional[list]]":
    """(trainer_state, rng_states); both are this project's own files, so full unpickling is safe here."""
    checkpoint = Path(checkpoint)
    trainer_state = torch.load(checkpoint / TRAINER_STATE_FILE, map_location="cpu", weights_only=False)
    rng_file = checkpoint / RNG_STATE_FILE
    rng_states = torch.load(rng_file, map_location="cpu", weights_only=False) if rng_file.is_file() else None
    return trainer_state, rng_states
