"""The one training loop behind gpt2/train.py and bert/train.py: settled flags, setup, steps, evaluation, saving."""
import contextlib
import datetime
import gc
import importlib.util
import logging
import math
import os
import platform
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import set_seed

from trace_tools.layout import PREVIOUS_RUN_DIR
from utils.chakra_tracer import TraceError, build_tracer, claim_trace_dir, default_trace_name
from utils.checkpointing import (BEST_MODEL, FINAL_MODEL, INITIAL_MODEL, RNG_STATE_FILE, TOKENIZER_FILES, SaveDirLock,
                                 capture_rng_state, check_resumable, check_writable_folder, checkpoint_name,
                                 clean_partial_checkpoints, earlier_checkpoints, later_checkpoints, load_resume_state,
                                 read_training_info, restore_rng_state, weights_fingerprint, write_checkpoint)
from utils.data_utils import (REAL_TOKENS, BatchStream, RepeatedBatch, TextExample, TextSplits, build_dataloader,
                              check_data_flags, load_text_splits, tokenize_examples)
from utils.distributed import DistributedContext, distributed_context, is_lost_peer_error, wrap_data_parallel
from utils.errors import (STOP_SIGNALS, CheckpointError, NonFiniteLossError, StopRequested, UsageError,
                          wait_for_rank_zero_to_report)
from utils.host_memory import keep_freed_memory_in_process
from utils.metrics import MetricSinks, count_parameters, flops_per_token, peak_flops_per_gpu
from utils.precision import bf16_refusal, default_precision, enable_tf32_matmuls
from utils.run_config import CheckpointArguments, RunConfig, RunSettings, parse_run_config
from utils.tokenization import TokenizerRequest, load_tokenizer

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003  # eval masks/dropout come from their own seed: same masks at every evaluation
LOG_FILE = "training_rank_{rank}.log"
# torchrun passes the user's Ctrl-C on to every rank, which the terminal already sent it: a second SIGINT this soon
# after the first, under torchrun, is that copy, not the user pressing Ctrl-C again.
TORCHRUN_SIGNAL_COPY_WINDOW_S = 1.0
# DataLoader worker processes per rank on GPU runs (collators that draw no random numbers only; see build_dataloader).
GPU_LOADER_WORKERS = 2


@dataclass(frozen=True)
class ModelFamily:
    """What differs between GPT-2 and BERT. Everything else (loop, DDP, logs, checkpoints, tracing) is shared.

    Args:
        name: the family's name in utils/families.py, which gives its default --model-name and --save-dir.
        title: one line for --help.
        model_class: GPT2LMHeadModel or BertForMaskedLM (from_pretrained on --resume-from).
        size_names: the accepted --model-name sizes (besides a local directory).
        resolve_config: --model-name -> config before the tokenizer is known (raises UsageError when unknown).
        tokenizer_request: (model name, config) -> where to look for a tokenizer and how to train a stand-in.
        prepare_tokenizer: fixes a loaded tokenizer up (GPT-2 has no pad token).
        finalize_config: sets vocabulary size and special token ids from the tokenizer.
        build_model: (config, attention implementation) -> a freshly initialised model.
        encode: (tokenizer, examples, max length) -> tokenizer output with overflow windows.
        make_collator: (tokenizer, max length) -> collate function producing model inputs with labels.
        random_collator: whether the collator draws random numbers (MLM masking); only one that does not may run
            in DataLoader workers, whose RNG streams a resume could not restore.
    """

    name: str
    title: str
    model_class: type
    size_names: tuple
    resolve_config: Callable
    tokenizer_request: Callable
    prepare_tokenizer: Callable
    finalize_config: Callable
    build_model: Callable
    encode: Callable
    make_collator: Callable
    random_collator: bool = True


# ---------------------------------------------------------------------------------------------- run settings
def settle_run(config: RunConfig, family: ModelFamily) -> RunSettings:
    """What the flags leave open, settled and checked against this machine and the files named, before any process
    group: a bad value fails at once with one line."""
    resume_dir = Path(config.checkpoint.resume_from) if config.checkpoint.resume_from else None
    model_name = config.model.model_name
    if resume_dir:
        check_resumable(resume_dir, model_type=family.model_class.config_class.model_type,
                        script=f"{family.name}/train.py", needs_tokenizer=not config.model.tokenizer_path)
        model_name = read_training_info(resume_dir).get("model_name") or model_name
        from transformers import AutoConfig
        model_config = AutoConfig.from_pretrained(str(resume_dir))
    else:
        model_config = family.resolve_config(model_name)
    check_data_flags(config.data.squad_file, config.data.dataset_path)
    precision = config.devices.precision or default_precision()
    check_precision_and_attention(precision, config.model.attn_implementation)
    positions = getattr(model_config, "max_position_embeddings", None) or config.data.max_seq_length
    run_name = Path(model_name).name if Path(model_name).is_dir() else model_name
    if run_name == "tiny":
        run_name = f"{family.name}-tiny"  # gpt2 and bert tiny runs must not share trace folders
    return RunSettings(model_name=model_name, run_name=run_name, precision=precision,
                       max_seq_length=min(config.data.max_seq_length, positions), resume_from=resume_dir)


def check_precision_and_attention(precision: str, attn_implementation: str) -> None:
    cuda = torch.cuda.is_available()
    if precision == "fp16" and not cuda:
        raise UsageError("--precision fp16 needs a CUDA GPU (it trains with a gradient scaler); use bf16 or fp32 on the CPU")
    if precision == "bf16" and bf16_refusal():
        raise UsageError(bf16_refusal())
    if attn_implementation == "flash_attention_2":
        if not cuda or precision == "fp32":
            raise UsageError("--attn-implementation flash_attention_2 needs a CUDA GPU and --precision bf16 or fp16")
        if importlib.util.find_spec("flash_attn") is None:
            raise UsageError("--attn-implementation flash_attention_2 needs the flash-attn package "
                             "(pip install flash-attn --no-build-isolation); or use sdpa")


# --------------------------------------------------------------------------------------------------- logging
class _ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.ERROR:
            return f"error: {message}"
        if record.levelno >= logging.WARNING:
            return f"warning: {message}"
        return message


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


def setup_logging(log_dir: Path, rank: int, world_size: int) -> list:
    """Rank 0 logs to the console (info to stdout, warnings and errors to stderr); every rank to its own file."""
    log_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    handlers = []
    log_file = _LogFileHandler(log_dir / LOG_FILE.format(rank=rank), mode="a", encoding="utf-8")
    log_file.setFormatter(logging.Formatter(f"%(asctime)s rank {rank}/{world_size} %(levelname)s %(name)s: %(message)s"))
    handlers.append(log_file)
    if rank == 0:
        stdout = logging.StreamHandler(sys.stdout)
        stdout.addFilter(_BelowWarning())
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setLevel(logging.WARNING)
        for handler in (stdout, stderr):
            handler.setFormatter(_ConsoleFormatter())
            handlers.append(handler)
    for handler in handlers:
        root.addHandler(handler)
    return handlers


class _LogFileHandler(logging.FileHandler):
    """A rank's log file. When it cannot be written (a full disk), the console says so once and carries on alone,
    instead of logging's '--- Logging error ---' traceback for every line."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: Optional[logging.LogRecord]) -> None:
        if self.failed:
            return
        self.failed = True
        exc = sys.exc_info()[1]
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        logger.warning("%s: cannot write the log file (%s); logging to the console only", self.baseFilename, reason)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the last lines could not be flushed
            self.handleError(None)


class _AroundProgressBar:
    """A console stream whose lines are written around the tqdm bar (tqdm.write) instead of through it."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        tqdm.write(text.rstrip("\n"), file=self.stream)

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def console_logging_around_bar():
    """Route the root logger's console handlers around the progress bar, each keeping its own stream and filters.

    tqdm's logging_redirect_tqdm replaces all console handlers with one that copies the first handler's filters,
    which silenced warnings (stdout's handler drops them; stderr's carried them).
    """
    consoles = [h for h in logging.getLogger().handlers
                if type(h) is logging.StreamHandler and h.stream in (sys.stdout, sys.stderr)]
    originals = [h.stream for h in consoles]
    for handler in consoles:
        handler.setStream(_AroundProgressBar(handler.stream))
    try:
        yield
    finally:
        for handler, stream in zip(consoles, originals):
            handler.setStream(stream)


def teardown_logging(handlers: list) -> None:
    root = logging.getLogger()
    for handler in handlers:
        root.removeHandler(handler)
        handler.close()


# ------------------------------------------------------------------------------------------- output folders
def check_output_folders(config: RunConfig, settings: RunSettings, ctx: DistributedContext) -> None:
    """Every folder this rank writes (rank 0's --save-dir, each rank's --log-dir and --trace-output-dir, and this
    run's trace folder in it) exists and takes a file, checked before the first step; a problem on any rank stops
    all of them with one line."""
    folders = [("--log-dir", config.checkpoint.log_dir)]
    if ctx.is_main_process:
        folders.insert(0, ("--save-dir", config.checkpoint.save_dir))
    if config.tracing.enable_tracing:
        folders.append(("--trace-output-dir", config.tracing.trace_output_dir))
    problem = None
    for flag, folder in folders:
        try:
            check_writable_folder(Path(folder), flag)
        except UsageError as exc:
            problem = str(exc)
            break
    if problem is None and config.tracing.enable_tracing:
        problem = trace_folder_problem(config, settings, ctx)
    problems = ctx.all_gather_object(problem)
    for rank, problem in enumerate(problems):
        if problem:
            raise UsageError(problem if rank == 0 else f"{problem} (on rank {rank})")


def trace_folder_problem(config: RunConfig, settings: RunSettings, ctx: DistributedContext) -> Optional[str]:
    """Why this run's trace folder, <trace-output-dir>/<trace-name>, cannot take the traces, or None: the tracer
    creates it only after setup, where a file of that name would end the run in a traceback."""
    tracing = config.tracing
    name = tracing.trace_name or default_trace_name(settings.run_name, ctx.world_size, ctx.device.type)
    trace_dir = Path(tracing.trace_output_dir) / name
    if trace_dir.exists() and not trace_dir.is_dir():
        return (f"--trace-output-dir {tracing.trace_output_dir}: {trace_dir} is a file, not a folder, and this run "
                "writes its traces there; move the file, or choose another --trace-name")
    if trace_dir.is_dir():
        try:
            check_writable_folder(trace_dir, "--trace-output-dir")
        except UsageError as exc:
            return str(exc)
    return None


def continued_checkpoints(flags: CheckpointArguments) -> "Optional[dict]":
    """When the run resumes from a checkpoint in its own --save-dir (continuing that run), {name: step} of the
    folders that run saved after it, which this one would write over (checkpoint-M, a best_model or final_model of a
    later step); None when it starts afresh or resumes from elsewhere."""
    save_dir = Path(flags.save_dir)
    if not flags.resume_from or Path(flags.resume_from).resolve().parent != save_dir.resolve():
        return None
    step = read_training_info(Path(flags.resume_from)).get("step")
    return later_checkpoints(save_dir, step) if isinstance(step, int) else {}


def refuse_earlier_checkpoints(flags: CheckpointArguments) -> None:
    """A --save-dir that holds another run's checkpoints is refused (they would be silently replaced), unless
    --overwrite-output-dir says so or the run resumes from one of them; resuming from one that the run saved later
    checkpoints after is refused too (they, and a better best_model, would be replaced), unless
    --overwrite-output-dir says so."""
    save_dir = Path(flags.save_dir)
    earlier = earlier_checkpoints(save_dir)
    if not earlier or flags.overwrite_output_dir:
        return
    later = continued_checkpoints(flags)
    if later is not None:
        if later:
            raise UsageError(later_checkpoints_refusal(flags, later))
        return
    steps = [name for name in earlier if name.startswith("checkpoint-")]
    resume = f"resume with --resume-from {save_dir / steps[-1]}, " if steps else ""
    raise UsageError(f"--save-dir {save_dir}: holds the checkpoints of an earlier run ({', '.join(earlier)}); "
                     f"{resume}choose another --save-dir, or pass --overwrite-output-dir to write over them")


def later_checkpoints_refusal(flags: CheckpointArguments, later: dict) -> str:
    """Why resuming from an earlier checkpoint of the run is refused, with the three ways on."""
    save_dir, resume = Path(flags.save_dir), Path(flags.resume_from)
    step = read_training_info(resume).get("step")
    names = ", ".join(name if name.startswith("checkpoint-") else
                      f"{name} of step {'unknown' if saved is None else saved}" for name, saved in later.items())
    latest = [name for name in later if name.startswith("checkpoint-")] or \
             [name for name in later if name == FINAL_MODEL and later[name] is not None]
    resume_latest = f"resume from {save_dir / latest[-1]} to continue the run, " if latest else ""
    return (f"--resume-from {resume}: {save_dir} holds what that run saved after step {step} ({names}), which this "
            f"run would write over; {resume_latest}choose another --save-dir to branch off from step {step}, or pass "
            f"--overwrite-output-dir to move them into {save_dir / PREVIOUS_RUN_DIR}")


def move_earlier_run_aside(flags: CheckpointArguments) -> None:
    """--overwrite-output-dir: the earlier run's checkpoint folders move into <save-dir>/.previous/ (replacing the
    run kept there before), so none of them passes for part of this run, yet that run is at hand until the next one.
    A run resumed from one of them continues that run: only what it saved after that step moves. A lone
    initial_model (a run that never saved a trained step) is deleted instead: .previous keeps the run before.

    They gather in .previous.incoming/ first, which replaces .previous/ only when complete: a run killed while
    moving leaves them there, and the next one finishes the move.
    """
    save_dir = Path(flags.save_dir)
    previous = save_dir / PREVIOUS_RUN_DIR
    incoming = save_dir / f"{PREVIOUS_RUN_DIR}.incoming"
    later = continued_checkpoints(flags)
    moving = list(later) if later is not None else earlier_checkpoints(save_dir)
    if not moving and not incoming.is_dir():
        return
    if moving == [INITIAL_MODEL] and not incoming.is_dir():
        try:
            shutil.rmtree(save_dir / INITIAL_MODEL)
        except OSError as exc:
            raise UsageError(f"--save-dir {save_dir}: cannot delete the earlier run's {INITIAL_MODEL} "
                             f"({exc.strerror or exc}); --overwrite-output-dir needs it out of the way") from None
        logger.warning("--overwrite-output-dir: deleted the earlier run's %s from %s (that run saved no trained step)%s",
                       INITIAL_MODEL, save_dir, f"; {previous} keeps the run before it" if previous.exists() else "")
        return
    try:
        incoming.mkdir(exist_ok=True)
        for name in moving:
            if (incoming / name).exists():  # left by a move killed halfway: the one in save_dir is newer
                shutil.rmtree(incoming / name)
            os.rename(save_dir / name, incoming / name)
        replaced = previous.exists()
        if replaced:
            shutil.rmtree(previous)
        os.rename(incoming, previous)
    except OSError as exc:
        raise UsageError(f"--save-dir {save_dir}: cannot move the earlier run's checkpoints aside into {previous} "
                         f"({exc.strerror or exc}); --overwrite-output-dir needs them out of the way") from None
    moved = ", ".join(sorted(p.name for p in previous.iterdir())) or "nothing"
    whose = (f"the checkpoints saved after --resume-from {flags.resume_from} (this run writes its own)"
             if later is not None else "the earlier run's")
    logger.warning("--overwrite-output-dir: moved %s %s from %s into %s%s", whose, moved, save_dir, previous,
                   " (deleting the run kept there before)" if replaced else "")


@contextlib.contextmanager
def claim_save_dir(flags: CheckpointArguments, ctx: DistributedContext):
    """Rank 0 locks --save-dir for this run, refuses a folder another live run writes to or that holds an earlier
    run's checkpoints, and removes the half-written folders of dead processes; every rank gets its verdict."""
    lock, problem = None, None
    if ctx.is_main_process:
        save_dir = Path(flags.save_dir)
        lock = SaveDirLock(save_dir)
        try:
            dead = lock.acquire()
            if dead:
                logger.warning("%s: took over the lock of pid %s on %s (started %s), which is no longer running",
                               lock.path, dead.get("pid"), dead.get("host"), dead.get("started"))
            refuse_earlier_checkpoints(flags)
            if flags.overwrite_output_dir:
                move_earlier_run_aside(flags)
            for action in clean_partial_checkpoints(save_dir):
                logger.info("%s: %s (left by a process that died while saving)", save_dir, action)
        except UsageError as exc:
            lock.release()
            lock, problem = None, str(exc)
    problem = ctx.broadcast_object(problem)
    if problem:
        raise UsageError(problem)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


# --------------------------------------------------------------------------------------------------- trainer
class Trainer:
    """Owns one rank's model, data, optimizer and checkpoints for a run; `setup()` then `train()`."""

    def __init__(self, config: RunConfig, settings: RunSettings, family: ModelFamily, ctx: DistributedContext):
        self.config, self.settings, self.family, self.ctx = config, settings, family, ctx
        self.device = ctx.device
        self.save_dir = Path(config.checkpoint.save_dir)
        self.step = 0
        self.tokens_seen = 0
        self.elapsed_before = 0.0       # seconds trained before a resume
        self.last_loss: Optional[float] = None
        self.last_lr: Optional[float] = None
        self.last_val_loss: Optional[float] = None
        self.best_val_loss = math.inf
        self.best_step: Optional[int] = None
        self.last_eval_step: Optional[int] = None
        self.last_checkpoint: Optional[Path] = None
        self.last_checkpoint_step: Optional[int] = None
        self.stop_signal: Optional[int] = None
        self._stop_requested_at = 0.0
        self.training_started = False   # signals then stop gracefully (a checkpoint) instead of at once
        self.resumed = False
        self._start_time = time.perf_counter()
        self._loop_first_step = 0        # self.step when the loop (and its tracer) started
        self._local_tokens_since_sync = 0   # real (non-padding) tokens this rank trained since the last sync
        self._tokens_since_log = 0          # real tokens of all ranks since the last log line with a loss
        self._rate_started = 0.0            # when those tokens began (perf_counter)

    # ---- setup -----------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Data and tokenizer, the model (sized to the tokenizer), loaders, optimizer, then the wrapped model."""
        logger.info(keep_freed_memory_in_process())
        seed = self.config.optim.seed
        set_seed(seed)  # Python, NumPy and torch: identical model initialisation on every rank
        self.splits = self._load_text()
        self.tokenizer, self.tokenizer_source = self._load_tokenizer()
        self.model = self._build_model()
        self.model_config = self.model.config
        self.train_data, self.val_data = self._tokenize()
        # from here on: per-rank dropout and masking streams (modulo 2**32: rank 1 of --seed 4294967295 had crashed)
        set_seed((seed + self.ctx.rank) % 2 ** 32)
        enable_tf32_matmuls(self.device)
        self.model.to(self.device)
        steps_per_epoch = self._build_loaders()
        self._build_optimization(steps_per_epoch)
        if self.settings.resume_from:
            self._restore(self.settings.resume_from)
            self._check_trace_window_fits_steps_left()
        self._wrap_and_measure()
        self._log_setup(steps_per_epoch)

    def _build_model(self):
        """The checkpoint's model with --resume-from, else a freshly initialised one with the tokenizer's vocabulary."""
        flags, settings = self.config.model, self.settings
        if settings.max_seq_length < self.config.data.max_seq_length:
            logger.warning("--max-seq-length %d exceeds the model's %d positions; using %d",
                           self.config.data.max_seq_length, settings.max_seq_length, settings.max_seq_length)
        if settings.resume_from:
            if settings.model_name != flags.model_name:
                logger.info("--resume-from: continuing %s's model %s (not --model-name %s)", settings.resume_from,
                            settings.model_name, flags.model_name)
            return self._load_checkpoint_model(settings.resume_from)
        config = self.family.resolve_config(settings.model_name)
        self.family.finalize_config(config, self.tokenizer)
        try:
            return self.family.build_model(config, flags.attn_implementation)
        except (ValueError, ImportError) as exc:
            raise UsageError(f"--attn-implementation {flags.attn_implementation}: {str(exc).splitlines()[0]}") from None

    def _build_loaders(self) -> int:
        """This rank's training and validation loaders; returns the optimizer steps of one epoch."""
        optim, ctx = self.config.optim, self.ctx
        collator = self.family.make_collator(self.tokenizer, self.settings.max_seq_length)
        pin = self.device.type == "cuda"
        options = dict(batch_size=optim.batch_size, rank=ctx.rank, world_size=ctx.world_size, seed=optim.seed,
                       pin_memory=pin, num_workers=GPU_LOADER_WORKERS if pin and not self.family.random_collator else 0)
        self.train_loader = build_dataloader(self.train_data, collator, train=True, **options)
        self.val_loader = build_dataloader(self.val_data, collator, train=False, **options)
        batches = len(self.train_loader)
        if batches == 0:
            raise UsageError(f"{self.splits.source}: {len(self.train_data)} training sequences are fewer than "
                             f"--batch-size {optim.batch_size} x {ctx.world_size} rank(s); use more data or a smaller batch")
        if optim.gradient_accumulation_steps > batches and not optim.overfit_one_batch:
            raise UsageError(f"--gradient-accumulation-steps {optim.gradient_accumulation_steps} is more than the "
                             f"{batches} batches of an epoch ({len(self.train_data)} training sequences, --batch-size "
                             f"{optim.batch_size} x {ctx.world_size} rank(s)): an optimizer step cannot take that "
                             f"many; use at most {batches}, or a smaller --batch-size")
        # The last step of an epoch takes the micro-batches left (_micro_batches_due), as transformers.Trainer does.
        return math.ceil(batches / optim.gradient_accumulation_steps)

    def _build_optimization(self, steps_per_epoch: int) -> None:
        """Step count, AdamW, the learning-rate schedule, the fp16 gradient scaler and the batch stream."""
        optim = self.config.optim
        self.max_steps = self.config.planned_steps(steps_per_epoch, self._resumed_step())
        self.warmup_steps = optim.warmup_steps if optim.warmup_steps is not None else int(0.1 * self.max_steps)
        if self.warmup_steps >= self.max_steps and self.ctx.is_main_process:
            # it had trained at a fraction of the rate asked for, silently (warm-up 100 over a 3-step run: 1e-6)
            logger.warning("--warmup-steps %d is not below the run's %d steps: the learning rate never reaches "
                           "--learning-rate %g", self.warmup_steps, self.max_steps, optim.learning_rate)
        self.optimizer = self._build_optimizer()
        from transformers import get_scheduler
        self.scheduler = get_scheduler(optim.lr_scheduler, optimizer=self.optimizer,
                                       num_warmup_steps=self.warmup_steps, num_training_steps=self.max_steps)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.settings.precision == "fp16")
        self.stream = RepeatedBatch(self.train_loader) if optim.overfit_one_batch else BatchStream(self.train_loader)

    def _resumed_step(self) -> int:
        """The step --resume-from continues after (its training_info.json), 0 for a fresh run: a traced run's window
        is counted from there."""
        if not self.settings.resume_from:
            return 0
        try:
            step = read_training_info(Path(self.settings.resume_from)).get("step")
        except CheckpointError:
            return 0  # _restore names what is wrong with the checkpoint
        return step if isinstance(step, int) and step > 0 else 0

    def _wrap_and_measure(self) -> None:
        """torch.compile and DDP around the model; its FLOPs per token, the peak to compare with, the metric sinks."""
        devices, ctx, seq = self.config.devices, self.ctx, self.settings.max_seq_length
        self.eval_model = torch.compile(self.model) if devices.compile else self.model
        self.train_model = wrap_data_parallel(self.eval_model, self.device) if ctx.is_distributed else self.eval_model
        self.n_params, compute_params = count_parameters(self.model)
        self.flops_per_token = flops_per_token(compute_params, self.model_config.num_hidden_layers,
                                               self.model_config.hidden_size, seq)
        self.peak_flops = peak_flops_per_gpu(self.device, self.settings.precision, devices.peak_tflops)
        self.tokens_per_micro_batch = ctx.world_size * self.config.optim.batch_size * seq
        self.sinks = MetricSinks(self.config.checkpoint.report_to, Path(self.config.checkpoint.log_dir),
                                 self.settings.run_name, self.arguments(), ctx.is_main_process)

    def arguments(self) -> dict:
        """Every flag as this run used it: the settled model name, precision and sequence length."""
        s = self.settings
        return {**self.config.flags(), "model_name": s.model_name, "precision": s.precision,
                "max_seq_length": s.max_seq_length}

    def _load_text(self) -> TextSplits:
        data, ctx = self.config.data, self.ctx
        options = dict(squad_file=data.squad_file, dataset_path=data.dataset_path, cache_dir=data.cache_dir,
                       validation_fraction=data.validation_fraction, seed=self.config.optim.seed)
        if data.squad_file or data.dataset_path or not ctx.is_distributed:
            return load_text_splits(**options)
        # The hub: rank 0 downloads (or finds it missing) first; the others follow its decision.
        splits = None
        with ctx.main_process_first():
            if ctx.is_main_process:
                splits = load_text_splits(**options)
        from_hub = ctx.broadcast_object(splits.source.startswith("hub:") if splits else None)
        return splits if splits is not None else load_text_splits(**options, allow_hub=from_hub)

    def _load_checkpoint_model(self, resume_dir: Path):
        try:
            return self.family.model_class.from_pretrained(str(resume_dir),
                                                           attn_implementation=self.config.model.attn_implementation)
        except Exception as exc:  # OSError, ValueError, safetensors' SafetensorError, shape mismatches
            raise CheckpointError(f"{resume_dir}: cannot load the model ({type(exc).__name__}: "
                                  f"{(str(exc).splitlines() or [''])[0][:300]})") from None

    def _load_tokenizer(self):
        resume_dir, flags = self.settings.resume_from, self.config.model
        if resume_dir and not flags.tokenizer_path:
            from transformers import AutoTokenizer
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(resume_dir))
            except Exception as exc:  # OSError, ValueError, the tokenizers library's own Exception
                raise CheckpointError(f"{resume_dir}: cannot load its tokenizer ({(str(exc).splitlines() or [''])[0]}); "
                                      "pass --tokenizer-path with the tokenizer this model was trained with") from None
            return self.family.prepare_tokenizer(tokenizer), str(resume_dir)
        model_name = self.settings.model_name
        request: TokenizerRequest = self.family.tokenizer_request(model_name, self.family.resolve_config(model_name))
        with self.ctx.main_process_first():  # rank 0 trains and caches a stand-in; the others load it
            tokenizer, source = load_tokenizer(request, tokenizer_path=flags.tokenizer_path,
                                               cache_dir=self.config.data.cache_dir,
                                               training_texts=self.splits.all_texts)
        tokenizer = self.family.prepare_tokenizer(tokenizer)
        if resume_dir:
            self._check_tokenizer_fits_checkpoint(tokenizer, resume_dir)
        return tokenizer, source

    def _check_tokenizer_fits_checkpoint(self, tokenizer, resume_dir: Path) -> None:
        """--tokenizer-path with --resume-from must be the tokenizer the checkpoint was trained with: another one
        maps text to other ids (or ids past the embedding) and the saved model would pair with the wrong one. Its
        size must match the model's embedding, and its vocabulary the checkpoint's own tokenizer files, if any."""
        from transformers import AutoConfig, AutoTokenizer
        given = f"--tokenizer-path {self.config.model.tokenizer_path}"
        rows = AutoConfig.from_pretrained(str(resume_dir)).vocab_size
        if len(tokenizer) != rows:
            raise UsageError(f"{given}: has {len(tokenizer)} tokens, but the model of --resume-from {resume_dir} has "
                             f"{rows}: not the tokenizer it was trained with")
        if not any((resume_dir / name).is_file() for name in TOKENIZER_FILES):
            return
        try:
            saved = self.family.prepare_tokenizer(AutoTokenizer.from_pretrained(str(resume_dir)))
        except Exception as exc:  # OSError, ValueError, the tokenizers library's own Exception
            logger.warning("%s: cannot read its tokenizer to compare it with --tokenizer-path (%s); only the sizes "
                           "were compared", resume_dir, (str(exc).splitlines() or [type(exc).__name__])[0])
            return
        if saved.get_vocab() != tokenizer.get_vocab():
            raise UsageError(f"{given}: its vocabulary differs from the tokenizer saved in --resume-from {resume_dir}; "
                             "leave --tokenizer-path out to use the checkpoint's own")

    def _tokenize(self):
        max_len = self.settings.max_seq_length

        def encode(examples: List[TextExample]):
            return self.family.encode(self.tokenizer, examples, max_len)

        train = tokenize_examples(encode, self.splits.train)
        val = tokenize_examples(encode, self.splits.validation)
        if len(val) == 0:  # GPT-2 packs text into full blocks: too little text fills none
            raise UsageError(f"{self.splits.source}: the validation split ({len(self.splits.validation)} example(s)) "
                             f"fills no sequence of --max-seq-length {max_len} tokens; use more data, a larger "
                             "--validation-fraction or a smaller --max-seq-length")
        return train, val

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW; matrices decay, biases and LayerNorm weights do not (the GPT-2/BERT recipe)."""
        decay, no_decay = [], []
        for param in self.model.parameters():
            if param.requires_grad:
                (decay if param.dim() >= 2 else no_decay).append(param)
        groups = [{"params": decay, "weight_decay": self.config.optim.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.config.optim.learning_rate, fused=self.device.type == "cuda")

    def _restore(self, resume_dir: Path) -> None:
        """Optimizer, scheduler, scaler, counters, data position and this rank's RNG streams."""
        ctx = self.ctx
        state, rng_states = load_resume_state(resume_dir)
        # As this run's flags made them: loading the saved states puts the saved run's values in their place.
        flagged = [{key: group[key] for key in ("initial_lr", "weight_decay")} for group in self.optimizer.param_groups]
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.scaler.load_state_dict(state["scaler"])
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"{resume_dir}/trainer_state.pt: the optimizer state does not fit this model "
                                  f"({(str(exc).splitlines() or [type(exc).__name__])[0]})") from None
        self._follow_this_runs_schedule(resume_dir, flagged)
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.elapsed_before = float(state["elapsed_seconds"])
        self.last_loss, self.last_val_loss = state.get("last_loss"), state.get("last_val_loss")
        self.best_val_loss = state.get("best_val_loss", math.inf)
        self.best_step = state.get("best_step")
        self.last_checkpoint, self.last_checkpoint_step = resume_dir, self.step
        self.resumed = True
        if not self.stream.load_state_dict(state["data"]):
            logger.warning("%s: %s: data order restarts at the beginning of epoch %d", resume_dir,
                           self._why_batching_differs(state), self.stream.epoch)
        if rng_states is not None and len(rng_states) == ctx.world_size:
            restore_rng_state(rng_states[ctx.rank], self.device)
        elif rng_states is None:  # it had said "holds RNG state for 0 rank(s)"
            logger.warning("%s has no %s: dropout and masking will not repeat the original run", resume_dir,
                           RNG_STATE_FILE)
        else:
            logger.warning("%s holds RNG state for %d rank(s), this run has %d: dropout and masking will not "
                           "repeat the original run", resume_dir, len(rng_states), ctx.world_size)
        for key, flag in (("world_size", None), ("gradient_accumulation_steps", "--gradient-accumulation-steps")):
            now = ctx.world_size if key == "world_size" else self.config.optim.gradient_accumulation_steps
            if state.get(key) not in (None, now):
                logger.warning("%s was trained with %s %s, this run uses %s", resume_dir, flag or "world size",
                               state.get(key), now)
        logger.info("resumed from %s at step %d (epoch %.2f)", resume_dir, self.step, self.stream.epochs_done)

    def _follow_this_runs_schedule(self, resume_dir: Path, flagged: list) -> None:
        """This run's --learning-rate and --weight-decay rule after a resume, not the ones the optimizer and scheduler
        states restored, and every step's learning rate follows this run's schedule (its length and warm-up may
        differ from the saved run's); a warning names what differs from the checkpoint."""
        groups, scheduler = self.optimizer.param_groups, self.scheduler
        saved_peak, saved_decay, saved_lr = groups[0]["initial_lr"], groups[0]["weight_decay"], groups[0]["lr"]
        for group, values in zip(groups, flagged):
            group.update(values)
        scheduler.base_lrs = [group["initial_lr"] for group in groups]
        # What scheduler.step() computes for the coming step (LambdaLR): equal to the saved lr when nothing differs
        for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports
        saved = read_training_info(resume_dir)
        saved_steps, arguments = saved.get("max_steps"), saved.get("arguments") or {}
        saved_warmup = arguments.get("warmup_steps")
        if saved_warmup is None and isinstance(saved_steps, int):
            saved_warmup = int(0.1 * saved_steps)  # the default, as _build_optimization settles it
        optim = self.config.optim
        compared = [("--learning-rate", optim.learning_rate, saved_peak),
                    ("--weight-decay", optim.weight_decay, saved_decay),
                    ("--lr-scheduler", optim.lr_scheduler, arguments.get("lr_scheduler")),
                    ("warm-up steps", self.warmup_steps, saved_warmup), ("total steps", self.max_steps, saved_steps)]
        differences = [f"{name} {now:g} (the checkpoint's {then:g})" if isinstance(now, float) else
                       f"{name} {now} (the checkpoint's {then})"
                       for name, now, then in compared if then is not None and now != then]
        if differences or groups[0]["lr"] != saved_lr:
            logger.warning("--resume-from %s: this run's settings apply from here on, not the checkpoint's: %s; step "
                           "%d trains at learning rate %.3g (the checkpoint's schedule: %.3g)", resume_dir,
                           ", ".join(differences) or "the learning-rate schedule", scheduler.last_epoch + 1,
                           groups[0]["lr"], saved_lr)

    def _why_batching_differs(self, state: dict) -> str:
        """Why a resumed run cannot continue the saved data order: its batches of an epoch are not the saved run's."""
        saved, stream, world = state["data"], self.stream, self.ctx.world_size
        if saved.get("batch_size") != stream.batch_size:
            return f"saved with --batch-size {saved.get('batch_size')}, this run uses {stream.batch_size}"
        before = f"an epoch was {saved.get('batches_per_epoch')} batches a rank"
        if state.get("world_size") not in (None, world):
            return (f"{before} with {state['world_size']} rank(s), and is {stream.batches_per_epoch} with this run's "
                    f"{world}")
        return (f"{before}, and is {stream.batches_per_epoch} with this run's data (another dataset, "
                "--validation-fraction or --max-seq-length)")

    def _check_trace_window_fits_steps_left(self) -> None:
        """A resumed run traces from the first step after its checkpoint: the steps left must hold the whole trace
        window, or the run would end with no trace or a shorter one (a fresh run's --max-steps is checked when the
        flags are parsed)."""
        if not self.config.tracing.enable_tracing:
            return
        wait, warmup, active = window = self.config.trace_window
        left = self.max_steps - self.step
        if left >= sum(window):
            return
        enough = self.step + sum(self.config.tracing.window(None))  # no shrinking of the defaults at that length
        raise UsageError(f"--resume-from {self.settings.resume_from}: resumes at step {self.step} of {self.max_steps}, "
                         f"leaving {max(left, 0)} step(s), fewer than the trace window of {sum(window)} (wait {wait} "
                         f"+ warmup {warmup} + active {active}); raise --max-steps to at least {enough} or lower the "
                         "--trace-*-steps")

    def _log_setup(self, steps_per_epoch: int) -> None:
        c, s, ctx, optim = self.config, self.settings, self.ctx, self.config.optim
        logger.info("%s %s: %s parameters, %s attention, precision %s%s, device %s x %d (%s)",
                    self.family.name, s.run_name, f"{self.n_params:,}", c.model.attn_implementation, s.precision,
                    ", torch.compile" if c.devices.compile else "", self.device.type, ctx.world_size,
                    ctx.backend or "1 process")
        logger.info("data: %s; %d train / %d validation sequences of up to %d tokens; tokenizer: %s (vocabulary %d)",
                    self.splits.source, len(self.train_data), len(self.val_data), s.max_seq_length,
                    self.tokenizer_source, len(self.tokenizer))
        logger.info("steps: %d (%d per epoch, %d warm-up); global batch %d sequences = %d per rank x %d micro-steps "
                    "x %d rank(s)", self.max_steps, steps_per_epoch, self.warmup_steps,
                    optim.batch_size * optim.gradient_accumulation_steps * ctx.world_size, optim.batch_size,
                    optim.gradient_accumulation_steps, ctx.world_size)

    # ---- training ----------------------------------------------------------------------------------------------
    def _autocast(self):
        if self.settings.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.settings.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _to_device(self, batch: dict) -> dict:
        """The model inputs of a batch on the device (the collator's token count stays behind)."""
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items() if k != REAL_TOKENS}

    def _optimizer_step(self, accumulation: int) -> "tuple[torch.Tensor, Optional[torch.Tensor]]":
        """The `accumulation` micro-steps of one optimizer step (_micro_batches_due): (this rank's mean loss, grad
        norm), both left on the device.

        Only what training itself does: forward, backward (DDP all-reduces the gradients), clipping, the optimizer.
        Reading the loss, which waits for the device, and agreeing with the other ranks happen on sync steps only
        (_sync_due), so the traced step holds no collective and no host sync of the trainer's own.
        """
        optim, model = self.config.optim, self.train_model
        model.train()
        loss_sum = None
        for micro in range(accumulation):
            batch = next(self.stream)
            self._local_tokens_since_sync += batch[REAL_TOKENS]  # counted by the collator: no device sync
            batch = self._to_device(batch)
            last = micro == accumulation - 1
            # Only the last micro-step all-reduces gradients; the others accumulate locally.
            sync = contextlib.nullcontext() if last or not self.ctx.is_distributed else model.no_sync()
            with sync:
                with self._autocast():
                    loss = model(**batch).loss
                self.scaler.scale(loss / accumulation).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        grad_norm = None
        if optim.max_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), optim.max_grad_norm)
        self.last_lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return (loss_sum / accumulation if accumulation > 1 else loss_sum), grad_norm

    def _micro_batches_due(self) -> int:
        """Micro-batches of the coming optimizer step: --gradient-accumulation-steps, but the last step of an epoch
        takes only the batches left in it, so an epoch is ceil(batches / accumulation) steps and --num-epochs N
        trains exactly N epochs (every rank's loader has as many batches: the ranks agree)."""
        accumulation = self.config.optim.gradient_accumulation_steps
        if not isinstance(self.stream, BatchStream):  # --overfit-one-batch: one batch, no epochs
            return accumulation
        left = self.stream.batches_per_epoch - self.stream.position
        return min(accumulation, left if left > 0 else self.stream.batches_per_epoch)

    # ---- sync steps: the loss read, agreed on and logged -------------------------------------------------------
    def _is_logging_step(self) -> bool:
        return self.step % self.config.checkpoint.logging_steps == 0 or self.step in (1, self.max_steps)

    def _is_loss_sync_step(self) -> bool:
        """A logging step that reads the loss: every one, or with --loss-sync-steps N every Nth step (and the
        first and last), so a run that logs each step's time need not meet the other ranks each step for it."""
        every = self.config.checkpoint.loss_sync_steps
        return self._is_logging_step() and (not every or self.step % every == 0 or self.step in (1, self.max_steps))

    def _inside_trace_window(self) -> bool:
        """Whether the profiler records the coming step: what the loop does now lands in that step's trace."""
        if not self.config.tracing.enable_tracing:
            return False
        coming = self.step - self._loop_first_step  # the tracer counts optimizer steps from the loop's start
        wait, warmup, active = self.config.trace_window
        return wait <= coming < wait + warmup + active

    def _sync_due(self, evaluation_or_checkpoint: bool) -> bool:
        """Whether this step reads the loss and agrees on it with the other ranks (torchtitan's way: on logging
        steps, not every step): logging steps outside the trace window, a step followed by an evaluation or a
        checkpoint (which sync anyway, and must not save non-finite weights), the last step, and in a one-process
        run a stop request at once. Ranks decide from the step number alone, so they meet in the all-reduce
        together; a stop request or a non-finite loss is therefore acted on at the next sync step."""
        if self.step == self.max_steps or evaluation_or_checkpoint:
            return True
        if not self.ctx.is_distributed and self.stop_signal is not None:
            return True
        return self._is_loss_sync_step() and not self._inside_trace_window()

    def _agree_on_loss_and_stop(self, loss: torch.Tensor) -> "tuple[float, bool]":
        """(this step's loss averaged over ranks, whether any rank was asked to stop); also sums the real tokens
        all ranks trained since the last sync. The trainer's one all-reduce and host sync, on sync steps only."""
        local = torch.tensor([float(self.stop_signal is not None), float(self._local_tokens_since_sync)],
                             dtype=torch.float64)
        stats = torch.cat([loss.detach().reshape(1).to(torch.float64), local.to(self.device)])
        if self.ctx.is_distributed:
            dist.all_reduce(stats)
        loss_sum, stops, tokens = stats.tolist()
        self._local_tokens_since_sync = 0
        self._tokens_since_log += int(tokens)
        mean_loss = loss_sum / self.ctx.world_size
        if not math.isfinite(mean_loss):
            where = self.last_checkpoint or "none (no checkpoint was saved yet)"
            raise NonFiniteLossError(
                f"loss is {mean_loss} at step {self.step}; stopped without saving it. Last good checkpoint: {where}. "
                "Lower --learning-rate, raise --warmup-steps, keep --max-grad-norm above 0, or use --precision "
                "bf16/fp32 instead of fp16")
        return mean_loss, stops > 0

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ranks; its own RNG seed, so training's random streams are untouched."""
        model = self.eval_model  # not the DDP wrapper: evaluation needs no gradient sync
        model.eval()
        totals = torch.zeros(2, device=self.device)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.config.optim.seed + EVAL_SEED_OFFSET + self.ctx.rank)
            for index, batch in enumerate(self.val_loader):
                if self.config.data.eval_batches and index >= self.config.data.eval_batches:
                    break
                with self._autocast():
                    loss = model(**self._to_device(batch)).loss.float()
                if torch.isfinite(loss):
                    totals += torch.stack([loss, torch.ones((), device=self.device)])
        if self.ctx.is_distributed:
            dist.all_reduce(totals)
        model.train()
        self.last_eval_step = self.step
        return (totals[0] / totals[1]).item() if totals[1] > 0 else math.nan

    def _evaluate_and_keep_best(self) -> None:
        val_loss = self.evaluate()
        self.last_val_loss = val_loss
        improved = math.isfinite(val_loss) and val_loss < self.best_val_loss
        perplexity = math.exp(val_loss) if val_loss < 50 else math.inf
        logger.info("eval at step %d | val loss %.4f | perplexity %.2f%s", self.step, val_loss, perplexity,
                    " | best so far" if improved else "")
        self.sinks.log({"eval/loss": val_loss, "eval/perplexity": perplexity}, self.step)
        if improved:
            self.best_val_loss, self.best_step = val_loss, self.step
            self.save(BEST_MODEL, kind="best")

    @contextlib.contextmanager
    def _stop_on_signals(self):
        """SIGTERM, Ctrl-C or a hang-up (STOP_SIGNALS): finish the current step, save a checkpoint, exit. A second
        Ctrl-C stops at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum, frame):
            if self.stop_signal is not None:
                copy_from_torchrun = ("TORCHELASTIC_RUN_ID" in os.environ and time.monotonic()
                                      - self._stop_requested_at < TORCHRUN_SIGNAL_COPY_WINDOW_S)
                if signum == signal.SIGINT and self.stop_signal == signal.SIGINT and not copy_from_torchrun:
                    raise KeyboardInterrupt
                return  # e.g. torchrun's SIGTERM right after the user's Ctrl-C: keep stopping gracefully
            self.stop_signal, self._stop_requested_at = signum, time.monotonic()
            logger.warning("%s received: saving a checkpoint after this step, then stopping "
                           "(Ctrl-C again to stop without saving)", signal.Signals(signum).name)

        previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run_info(self) -> dict:
        c, s = self.config, self.settings
        return {"model": s.run_name, "family": self.family.name, "model_config": self.model_config.to_dict(),
                "num_parameters": self.n_params, "batch_size_per_rank": c.optim.batch_size,
                "sequence_length": s.max_seq_length, "precision": s.precision, "compile": c.devices.compile,
                "attention": c.model.attn_implementation,
                "gradient_accumulation_steps": c.optim.gradient_accumulation_steps,
                "world_size": self.ctx.world_size, "data_source": self.splits.source,
                "tokenizer_source": self.tokenizer_source,
                # every multi-rank run is DDP over one world group: what scale_et.py checks before scaling
                "parallelism": {"data_parallel": self.ctx.world_size, "tensor_parallel": 1, "pipeline_parallel": 1,
                                "wrapper": "DistributedDataParallel" if self.ctx.is_distributed else None}}

    def train(self) -> int:
        """The loop; returns the process exit status (0, or 128 + signal number after a graceful stop). A signal
        stops gracefully up to the last save, so even one during the final save ends with a whole checkpoint."""
        self.training_started = True
        with self._stop_on_signals():
            return self._train_and_save()

    def _train_and_save(self) -> int:
        if not self.resumed and not self.config.checkpoint.no_save_initial:
            self.save(INITIAL_MODEL, kind="initial")
        try:
            stopped = self._loop()
            if not stopped and self.step > 0 and self.last_eval_step != self.step:
                self._evaluate_and_keep_best()  # its eval/* scalars go to the sinks, so they close only after it
        finally:
            self.sinks.close()
        if stopped:
            name = checkpoint_name(self.step)
            if self.last_checkpoint != self.save_dir / name:
                self.save(name, kind="interrupted")
            logger.warning("stopped by %s at step %d; resume with --resume-from %s",
                           signal.Signals(self.stop_signal or signal.SIGTERM).name, self.step, self.save_dir / name)
            return 128 + int(self.stop_signal or signal.SIGTERM)
        fingerprint = weights_fingerprint(self.model)
        self.save(FINAL_MODEL, kind="final", extra={"weights_sha256": fingerprint})
        self._check_ranks_agree(fingerprint)
        logger.info("done: %d steps in %.1f s; final loss %s; best val loss %.4f at step %s; checkpoints in %s",
                    self.step, self.elapsed(), f"{self.last_loss:.4f}" if self.last_loss is not None else "n/a",
                    self.best_val_loss, self.best_step, self.save_dir)
        return 0

    def _loop(self) -> bool:
        """Optimizer steps up to max_steps; True when a signal asked to stop early."""
        every, ctx = self.config.checkpoint, self.ctx
        if self.step >= self.max_steps:
            # a warning, on stderr: the run ends "done" with the checkpoint's weights, and a resumed run whose
            # --max-steps (or epochs) was meant to be raised should be told (a requeued finished run may be meant)
            logger.warning("--resume-from %s: already at step %d, and this run ends at step %d: nothing to train; "
                           "raise --max-steps (or --num-epochs) to train on", self.settings.resume_from, self.step,
                           self.max_steps)
            return False
        window_start, window_steps, cpu_start = time.perf_counter(), 0, time.process_time()
        self._loop_first_step, self._rate_started = self.step, window_start
        # The bar shows only on a terminal (disable=None); there, log lines are routed around it. Elsewhere
        # (nohup, pipes) the handlers stay as they are: info on stdout, warnings on stderr.
        progress = tqdm(total=self.max_steps, initial=self.step, desc=f"{self.family.name} training",
                        unit="step", disable=None if ctx.is_main_process else True, dynamic_ncols=True)
        around_bar = contextlib.nullcontext() if progress.disable else console_logging_around_bar()
        with build_tracer(self.config, rank=ctx.rank, world_size=ctx.world_size, local_rank=ctx.local_rank,
                          device=self.device, run_info=self._run_info(), first_log_step=self.step + 1,
                          resumed_from=self.settings.resume_from if self.resumed else None) as tracer, \
                around_bar:
            evaluation_due = checkpoint_due = own_work = False  # own_work: the loop's own, since the last step
            try:
                while self.step < self.max_steps:
                    micro_batches = self._micro_batches_due()  # read before the step takes them
                    # The step's clocks start here, so what the loop did since the last step (below) is in none
                    tracer.start_step(after_own_work=own_work)
                    loss, grad_norm = self._optimizer_step(micro_batches)
                    # the tracer's own preparation for its window is left out of the pace the log reports
                    preparation_s, preparation_cpu_s = tracer.step(micro_batches)
                    window_start += preparation_s
                    cpu_start += preparation_cpu_s
                    self._rate_started += preparation_s  # tokens/s too (it had shown 478 tok/s beside 8.8 ms/step)
                    self.step += 1
                    self.tokens_seen += self.tokens_per_micro_batch * micro_batches
                    window_steps += 1
                    progress.update(1)
                    stop = own_work = False
                    new_evaluation = bool(every.eval_steps) and self.step % every.eval_steps == 0
                    new_checkpoint = bool(every.save_steps) and self.step % every.save_steps == 0
                    evaluation_due, checkpoint_due = evaluation_due or new_evaluation, checkpoint_due or new_checkpoint
                    # Between two traced steps the profiler records whatever runs: an evaluation or a checkpoint
                    # due there waits until the window has closed, so the traces hold training alone
                    held = (evaluation_due or checkpoint_due) and tracer.inside_traced_steps()
                    if held and (new_evaluation or new_checkpoint):
                        logger.info("step %d: %s due, held until the trace window closes", self.step,
                                    " and ".join(w for w, due in (("evaluation", evaluation_due),
                                                                  ("checkpoint", checkpoint_due)) if due))
                    if self._sync_due(evaluation_or_checkpoint=(evaluation_due or checkpoint_due) and not held):
                        self.last_loss, stop = self._agree_on_loss_and_stop(loss)
                        own_work = True
                        progress.set_postfix(loss=f"{self.last_loss:.4f}", refresh=False)
                        if self._is_logging_step() or stop:
                            now, cpu_now = time.perf_counter(), time.process_time()
                            self._log_step(self.last_loss, grad_norm, window_steps, now - window_start,
                                           cpu_now - cpu_start, now)
                            window_start, window_steps, cpu_start = now, 0, cpu_now
                    elif self._is_logging_step():  # the time only, nothing read back
                        now, cpu_now = time.perf_counter(), time.process_time()
                        self._log_step_time(window_steps, now - window_start, cpu_now - cpu_start)
                        window_start, window_steps, cpu_start = now, 0, cpu_now
                        own_work = True
                    if evaluation_due and not held:
                        self._evaluate_and_keep_best()
                        evaluation_due, own_work = False, True
                    if checkpoint_due and not held:
                        self.save(checkpoint_name(self.step), kind="checkpoint")
                        checkpoint_due, own_work = False, True
                    if stop:
                        return True
            finally:
                progress.close()
        return False

    def _log_step_time(self, steps: int, seconds: float, cpu_seconds: float) -> None:
        """A logging step that reads nothing back: its host time, without the loss. Inside the trace window (the
        loss's all-reduce and device read would land in the traced step; the next line after the window has the
        loss and tokens/s), or between loss reads (--loss-sync-steps), where the CPU time per step is given too."""
        if self._inside_trace_window():
            note = "loss read after the trace window"  # the step just logged may precede it: the read would be in it
        else:
            note = (f"cpu {1000 * cpu_seconds / steps:.1f} ms/step | between loss reads "
                    f"(every {self.config.checkpoint.loss_sync_steps} steps)")
        logger.info("step %d/%d | epoch %.2f | lr %.3g | %.1f ms/step | %s", self.step, self.max_steps,
                    self.stream.epochs_done, self.last_lr, 1000 * seconds / steps, note)

    def _log_step(self, loss: float, grad_norm, steps: int, seconds: float, cpu_seconds: float, now: float) -> None:
        """The step line: loss, rates and the wall-clock time per step, then the process's CPU time per step (all
        its threads: on a CPU run the work itself, without the waits for the network or another rank). now: the
        clock reading that ends `seconds`, so tokens/s and ms/step span the same time (read again here, a process
        descheduled between the two readings on a busy machine had 2.8 ms less in tokens/s than in a 16 ms step)."""
        # Real tokens only (padding left out), of all ranks, since the last line with a loss (window lines skip it).
        tokens_per_s = self._tokens_since_log / max(now - self._rate_started, 1e-9)
        self._tokens_since_log, self._rate_started = 0, now
        parts = [f"step {self.step}/{self.max_steps}", f"epoch {self.stream.epochs_done:.2f}", f"loss {loss:.4f}",
                 f"lr {self.last_lr:.3g}"]
        scalars = {"train/loss": loss, "train/learning_rate": self.last_lr, "train/tokens_per_second": tokens_per_s}
        if grad_norm is not None:
            scalars["train/grad_norm"] = float(grad_norm)
            parts.append(f"grad norm {float(grad_norm):.3f}")
        parts += [f"{tokens_per_s:,.0f} tok/s", f"{1000 * seconds / steps:.1f} ms/step",
                  f"cpu {1000 * cpu_seconds / steps:.1f} ms/step"]
        if self.peak_flops:
            mfu = self.flops_per_token * tokens_per_s / (self.peak_flops * self.ctx.world_size)
            scalars["train/mfu"] = mfu
            parts.append(f"mfu {100 * mfu:.1f}%")
        logger.info(" | ".join(parts))
        self.sinks.log(scalars, self.step)

    def release(self) -> None:
        """Drop the DDP wrapper while the process group still exists.

        Freed later, its reducer would destroy the gloo group from Python's garbage collection, joining gloo
        threads that wait for the GIL the collector holds: a hang at exit.
        """
        for name in ("train_model", "eval_model", "model", "optimizer", "scheduler"):
            if hasattr(self, name):
                setattr(self, name, None)
        gc.collect()

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self._start_time

    def save(self, name: str, kind: str, extra: Optional[dict] = None) -> Path:
        """Every rank calls this (its RNG state is gathered); rank 0 writes the folder atomically."""
        target = self.save_dir / name
        rng_states = self.ctx.all_gather_object(capture_rng_state(self.device))
        failure = None
        if self.ctx.is_main_process:
            info = self._training_info(kind)
            info.update(extra or {})
            try:
                write_checkpoint(target, model=self.model, tokenizer=self.tokenizer, info=info,
                                 trainer_state=self._trainer_state(), rng_states=rng_states)
                logger.info("saved %s (step %d)", target, self.step)
            except CheckpointError as exc:
                failure = self._save_failure_message(str(exc))
        failure = self.ctx.broadcast_object(failure)  # the other ranks stop with rank 0 instead of hanging
        if failure:
            raise CheckpointError(failure)
        self.last_checkpoint, self.last_checkpoint_step = target, self.step
        return target

    def _save_failure_message(self, problem: str) -> str:
        last = self.last_checkpoint
        if last is not None and Path(last).is_dir():
            return (f"{problem}; the last good checkpoint is {last}: make room, then rerun the same command with "
                    f"--resume-from {last}")
        return f"{problem}; no checkpoint of this run was saved before it: make room and start again"

    def _trainer_state(self) -> dict:
        return {"step": self.step, "data": self.stream.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "tokens_seen": self.tokens_seen, "elapsed_seconds": self.elapsed(), "last_loss": self.last_loss,
                "last_val_loss": self.last_val_loss, "best_val_loss": self.best_val_loss, "best_step": self.best_step,
                "world_size": self.ctx.world_size, "batch_size": self.config.optim.batch_size,
                "gradient_accumulation_steps": self.config.optim.gradient_accumulation_steps}

    def _training_info(self, kind: str) -> dict:
        import transformers
        optim, s = self.config.optim, self.settings
        return {
            "kind": kind, "step": self.step, "max_steps": self.max_steps, "epoch": round(self.stream.epochs_done, 4),
            "loss": self.last_loss, "learning_rate": self.scheduler.get_last_lr()[0],
            "val_loss": self.last_val_loss, "best_val_loss": self.best_val_loss if self.best_step is not None else None,
            "best_step": self.best_step, "world_size": self.ctx.world_size,
            "global_batch_size": optim.batch_size * optim.gradient_accumulation_steps * self.ctx.world_size,
            "sequence_length": s.max_seq_length, "tokens_seen": self.tokens_seen,
            "elapsed_seconds": round(self.elapsed(), 3), "model_name": s.model_name,
            "model_type": self.model_config.model_type,
            "num_parameters": self.n_params, "data_source": self.splits.source, "tokenizer_source": self.tokenizer_source,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "arguments": self.arguments(),
        }

    def _check_ranks_agree(self, fingerprint: str) -> None:
        logger.info("final weights sha256 %s (rank %d)", fingerprint, self.ctx.rank)
        fingerprints = self.ctx.all_gather_object(fingerprint)
        if len(fingerprints) > 1:
            if len(set(fingerprints)) == 1:
                logger.info("weights identical on all %d ranks", len(fingerprints))
            else:
                logger.warning("weights differ between ranks: %s", fingerprints)


# ------------------------------------------------------------------------------------------------ entry point
def out_of_memory_advice(arguments: dict, rank: int) -> str:
    a = arguments
    return (f"CUDA out of memory on rank {rank} (--model-name {a['model_name']}, --batch-size {a['batch_size']}, "
            f"--max-seq-length {a['max_seq_length']}, --precision {a['precision']}). Lower --batch-size (raise "
            "--gradient-accumulation-steps to keep the global batch), lower --max-seq-length, use --precision bf16 "
            "or fp16, or choose a smaller --model-name")


def main(family: ModelFamily, argv: Optional[list] = None) -> int:
    """Parse, check, train; the process exit status. Errors a user can fix print one `error:` line, no traceback."""
    config = parse_run_config(family.name, argv, description=family.title, size_names=family.size_names)
    handlers, root_level = [], logging.getLogger().level
    rank = int(os.environ.get("RANK", "0")) if os.environ.get("RANK", "0").isdigit() else 0
    trainer = None
    try:
        with signals_stop_setup():
            settings = settle_run(config, family)
            with distributed_context(config.devices.num_gpus) as ctx:
                rank = ctx.rank
                check_output_folders(config, settings, ctx)
                handlers = setup_logging(Path(config.checkpoint.log_dir), ctx.rank, ctx.world_size)
                _quiet_library_progress_bars()
                # The trace folder first: a run refused there must not have moved the earlier checkpoints aside
                with claim_trace_dir(config, ctx, settings.run_name), claim_save_dir(config.checkpoint, ctx):
                    trainer = Trainer(config, settings, family, ctx)
                    try:
                        trainer.setup()
                        return trainer.train()
                    finally:
                        trainer.release()
    except UsageError as exc:
        # all ranks hit the same error: rank 0 says it once
        _report_error(str(exc), handlers, rank, every_rank=False, shared=True)
        return 1
    except TraceError as exc:  # the tracer gathers every rank's problems, so each rank raises the same
        _report_error(str(exc), handlers, rank, every_rank=False, shared=True)
        return 1
    except torch.cuda.OutOfMemoryError:
        arguments = trainer.arguments() if trainer else config.flags()
        _report_error(out_of_memory_advice(arguments, rank), handlers, rank, every_rank=True)
        return 1
    except (KeyboardInterrupt, StopRequested) as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        _report_error(interruption_message(signum, trainer), handlers, rank, every_rank=False)
        return 128 + signum
    except RuntimeError as exc:
        # A collective whose peer process is gone (killed, crashed): that rank's own lines say why; this one says
        # where the run stopped, not gloo's 30-line traceback
        world_size = os.environ.get("WORLD_SIZE", "1")
        if not (is_lost_peer_error(exc) and world_size.isdigit() and int(world_size) > 1):
            raise
        started = trainer is not None and trainer.training_started
        last = trainer.last_checkpoint if started else None
        where = (f"the last checkpoint is {last} (step {trainer.last_checkpoint_step}): resume with --resume-from "
                 f"{last}" if last else "no checkpoint of this run was saved")
        _report_error(f"another rank was lost {f'at step {trainer.step}' if started else 'before training started'} "
                      f"(a collective's connection was closed by that rank's process; its own messages say why); "
                      f"{where}", handlers, rank, every_rank=True)
        return 1
    finally:
        teardown_logging(handlers)
        logging.getLogger().setLevel(root_level)


@contextlib.contextmanager
def signals_stop_setup():
    """Until the training loop (which saves a checkpoint first) there is nothing to save: Ctrl-C raises
    KeyboardInterrupt and SIGTERM StopRequested, which main() reports in one line. Ignored signals stay ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt if signum == signal.SIGINT else StopRequested(signum)

    previous = {}
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def interruption_message(signum: int, trainer: Optional[Trainer]) -> str:
    """What an interrupted run leaves: nothing before the loop, else the last checkpoint to resume from."""
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    if trainer is None or not trainer.training_started:
        return f"interrupted by {name} before training started: nothing was saved"
    last = trainer.last_checkpoint
    where = (f"the last checkpoint is {last} (step {trainer.last_checkpoint_step}): resume with --resume-from {last}"
             if last else "no checkpoint of this run was saved")
    again = "a second Ctrl-C" if signum == signal.SIGINT and trainer.stop_signal == signal.SIGINT else name
    return f"interrupted by {again} at step {trainer.step}: stopped at once; {where}"


def _report_error(message: str, handlers: list, rank: int, every_rank: bool, shared: bool = False) -> None:
    """One `error:` line on the console: from rank 0, or from any rank for rank-specific errors (out of memory).
    With logging set up it also lands in the rank's log file. Another rank with a shared error (every rank hit it)
    waits for torchrun to stop it, so rank 0 gets to print it (see wait_for_rank_zero_to_report)."""
    if handlers:
        logger.error(message)  # rank 0's console handler prints it; other ranks have only their file
    if rank != 0 and every_rank:
        print(f"error: [rank {rank}] {message}", file=sys.stderr)
    elif not handlers and rank == 0:
        print(f"error: {message}", file=sys.stderr)
    elif rank != 0 and shared:
        wait_for_rank_zero_to_report(message, rank)


def _quiet_library_progress_bars() -> None:
    """transformers 5 draws progress bars while saving and loading weights; the training bar is enough."""
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except (ImportError, AttributeError):
        pass
