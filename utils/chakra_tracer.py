"""Chakra trace capture: one host (ExecutionTraceObserver) and one device (Kineto) trace per rank, same steps."""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import platform
import resource
import shutil
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import orjson
import torch
import torch.distributed as dist
from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile, schedule

from trace_tools.atomic import write_text_atomic
from trace_tools.layout import (INVALID_SUFFIX, PARTIAL_SUFFIX, PG_INIT_NODE, PREVIOUS_RUN_DIR,
                                RUN_INFO, RUN_METADATA_KEY, STACKS_TABLE, STEP_ANNOTATION, derived_file,
                                device_trace_name, host_trace_name)
from trace_tools.load import describe_json_problem
from utils.checkpointing import SaveDirLock
from utils.collective_start import measure_collective_start_wait_s
from utils.distributed import is_lost_peer_error
from utils.errors import UsageError
from utils.host_memory import reserve_heap_for_profiler
from utils.metrics import (busy_machine_warning, interrupt_cpu_seconds, machine_load_between, sample_machine_load,
                           schedstat_fields, schedstat_seconds)
from utils.run_config import RunConfig, folder_name_problem
from utils.wake_cost import measure_wake_cost_s

logger = logging.getLogger(__name__)

# Held in the trace folder while a run traces into it (TraceDirLock)
TRACE_LOCK_FILE = ".tracing.lock"
# Free space below which a trace folder's file system counts as full: Kineto's export and the observer do not report
# their write errors, they leave a missing or cut-short file
FULL_FOLDER_BYTES = 1 << 20


class TraceError(RuntimeError):
    """A trace could not be captured or is not one valid JSON document."""


def default_trace_name(model: str, world_size: int, device_type: str) -> str:
    """<model>_<N>gpu on CUDA, <model>_<N>cpu otherwise (a model given as a path keeps one folder level)."""
    model = model.strip("/\\").replace("/", "-").replace("\\", "-").lstrip(".") or "model"
    return f"{model}_{world_size}{'gpu' if device_type == 'cuda' else 'cpu'}"


def build_tracer(config: RunConfig, *, rank: int, world_size: int, local_rank: int,
                 device: torch.device | str, run_info: dict[str, Any], first_log_step: int = 1,
                 resumed_from: str | os.PathLike | None = None) -> ChakraTracer | NullTracer:
    """ChakraTracer when --enable-tracing is given, else a NullTracer that does nothing.

    Args:
        config: the run's flags; its trace window was checked when they were parsed (utils/run_config.py).
        rank, world_size, local_rank: this process's place in the job.
        device: the device the model trains on; CUDA activity is recorded when it is a CUDA device.
        run_info: what the trainer knows, written to run.json: "model" (name, used for the default trace name),
            "model_config", "batch_size_per_rank", "sequence_length", "precision", "compile", "attention",
            "gradient_accumulation_steps", and anything else worth keeping.
        first_log_step: the number the run's log gives the tracer's first step (a resumed run's is past 1).
        resumed_from: the checkpoint a resumed run started from (run.json's resumed_from).
    """
    if not config.tracing.enable_tracing:
        return NullTracer()
    device = torch.device(device)
    wait, warmup, active = config.trace_window
    start = first_log_step - 1  # the step a resumed run continues after
    reached, after = config.after_steps_reached(start), config.trace_after_steps
    if rank == 0 and config.timed_untraced_steps(start) and reached < after:
        # The first steps warm up (utils/run_config.py, DEFAULT_WAIT_STEPS): without the steps after the window the
        # untraced pace comes from them alone
        logger.warning("trace window: --max-steps %d ends the run %d step(s) after the window, so %d of the %d "
                       "untraced steps to time after it are timed and the untraced pace the .et is corrected towards "
                       "comes %s from the run's first steps, which still warm up: raise --max-steps to %d",
                       config.optim.max_steps, reached, reached, after, "mostly" if reached else "only",
                       start + wait + warmup + active + after)
    if rank == 0 and wait + warmup == 0:
        # step 0 allocates the model's and the optimizer's memory and builds DDP's buckets: as one of the traced
        # steps, its one-time work is in the .et (a GPT-2 tiny step 0 faulted 2,011 pages, a later step none)
        logger.warning("trace window: --trace-wait-steps 0 and --trace-warmup-steps 0 trace the run's first step, "
                       "whose start-up (memory allocation, DDP's bucket building) the traces then hold as if every "
                       "step did it: give --trace-warmup-steps 1 or more")
    if rank == 0 and not config.timed_untraced_steps(start):
        # The conversion takes the profiler's cost out of the .et against the untraced pace, the run's first step
        # (its start-up) left out: with none timed the .et keeps it, over twice a GPT-2 tiny step on a CPU
        logger.warning("trace window: --trace-wait-steps %d and --trace-after-steps %d time no untraced step after the "
                       "run's first (%s), so the .et files will keep the profiler's cost: give --trace-wait-steps 2 or "
                       "more, or --trace-after-steps 1 or more", wait, config.trace_after_steps,
                       "--max-steps ends the run with the window" if config.trace_after_steps else "none after it")
    run_info = {**run_info, "resumed_from": str(resumed_from) if resumed_from is not None else None}
    return ChakraTracer(
        output_dir=config.tracing.trace_output_dir,
        trace_name=trace_name_of(config, str(run_info.get("model") or "model"), world_size, device.type),
        wait_steps=wait, warmup_steps=warmup, active_steps=active, after_steps=config.trace_after_steps, rank=rank,
        world_size=world_size, local_rank=local_rank, device=device, run_info=run_info, first_log_step=first_log_step)


def trace_name_of(config: RunConfig, model: str, world_size: int, device_type: str) -> str:
    """This run's trace folder name: --trace-name, else default_trace_name."""
    return config.tracing.trace_name or default_trace_name(model, world_size, device_type)


# Trace-folder locks held by claim_trace_dir in this process, by folder: the tracer for that folder uses the held one
# (a second flock of the lock file by this process would be refused as another run's)
_CLAIMED_TRACE_DIRS: dict[Path, TraceDirLock] = {}


@contextlib.contextmanager
def claim_trace_dir(config: RunConfig, ctx: Any, model: str) -> Iterator[None]:
    """With --enable-tracing, rank 0 locks this run's trace folder for the whole run and every rank gets its
    refusal (a TraceError: another run traces into it), before the run writes or moves anything: the tracer took
    the lock only when the loop began, after --overwrite-output-dir had moved the earlier run's checkpoints to
    <save-dir>/.previous/ (replacing the run kept there) and initial_model was saved, so two refused retries lost a
    finished run's best_model and final_model. The tracer built for this folder then uses this lock and releases
    it once its window is published.

    Args:
        config: the run's flags.
        ctx: the run's DistributedContext (utils/distributed.py): rank, world_size, device, broadcast_object.
        model: the run's name, for the default trace name (the model the tracer's run_info names).
    """
    if not config.tracing.enable_tracing:
        yield
        return
    trace_dir = Path(config.tracing.trace_output_dir) / trace_name_of(config, model, ctx.world_size, ctx.device.type)
    lock, refusal, created = None, None, not trace_dir.exists()
    if ctx.rank == 0:
        lock = TraceDirLock(trace_dir)
        refusal = take_trace_dir_lock(lock)
    refusal = ctx.broadcast_object(refusal)
    if refusal:
        raise TraceError(refusal)
    key = trace_dir.resolve()
    if lock is not None:
        _CLAIMED_TRACE_DIRS[key] = lock
    try:
        yield
    finally:
        if lock is not None:
            _CLAIMED_TRACE_DIRS.pop(key, None)
            lock.release()
            if created:  # a run stopped before it traced leaves no empty folder behind
                with contextlib.suppress(OSError):
                    trace_dir.rmdir()


def take_trace_dir_lock(lock: TraceDirLock) -> str | None:
    """Take a trace folder's lock; why it could not (another run traces into it), or None."""
    try:
        taken_over = lock.acquire()
    except UsageError as exc:
        return str(exc)
    if taken_over:
        logger.warning("%s: took over the lock of a run that is gone (pid %s on %s)", lock.save_dir,
                       taken_over.get("pid"), taken_over.get("host"))
    return None


class NullTracer:
    """Stands in for ChakraTracer when tracing is off: no profiler, no observer, no files."""

    enabled = False
    trace_dir = None

    def __enter__(self) -> NullTracer:
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> bool:
        return False

    def start_step(self, after_own_work: bool = False) -> None:
        pass

    def inside_traced_steps(self) -> bool:
        return False

    def step(self, micro_batches: int | None = None) -> tuple[float, float]:
        return 0.0, 0.0


class ChakraTracer:
    """Owns the profiler and ExecutionTraceObserver lifecycle of one rank, used as
    ``with ChakraTracer(...) as tracer: ... tracer.step()`` with one step() per optimizer step.

    Follows Chakra's capture recipe (trace_collection/post_execution/simple_multirank.py): the observer is passed
    to torch.profiler.profile, which starts and stops it with Kineto, so host and device traces cover exactly the
    same steps. Once the single-cycle window has been recorded both are finalised at once, so the rest of the run
    pays nothing. After the last timed step the ranks agree to publish, rename their files into place, gather the
    per-step times, rank 0 writes run.json and releases the trace folder, while the run goes on; __exit__ raises
    what went wrong then, or handles a run that ended before (a window cut short is removed unexported).

    Args:
        output_dir: parent folder of the run folders.
        trace_name: this run's folder name inside output_dir.
        wait_steps, warmup_steps, active_steps: torch.profiler.schedule of the single window.
        after_steps: untraced steps timed after the window, as the wait steps are (default: as many as those), so
            the untraced pace comes from both sides of the window and not from a run's first steps alone.
        rank, world_size, local_rank: this process's place in the job.
        device: training device; CUDA activity is recorded on CUDA devices.
        run_info: trainer-provided facts for run.json (see build_tracer).
    """

    enabled = True

    def __init__(self, output_dir: str | os.PathLike, trace_name: str, wait_steps: int = 1, warmup_steps: int = 1,
                 active_steps: int = 1, after_steps: int | None = None, rank: int = 0, world_size: int = 1,
                 local_rank: int = 0, device: torch.device | str = "cpu",
                 run_info: dict[str, Any] | None = None, first_log_step: int = 1) -> None:
        after_steps = wait_steps if after_steps is None else after_steps
        if active_steps < 1 or wait_steps < 0 or warmup_steps < 0 or after_steps < 0:
            raise ValueError(f"trace window needs wait >= 0, warmup >= 0, active >= 1, after >= 0; "
                             f"got {wait_steps}/{warmup_steps}/{active_steps}/{after_steps}")
        problem = folder_name_problem(trace_name)
        if problem:
            raise TraceError(f"trace name {trace_name!r}: {problem}; give a plain folder name, made inside {output_dir}")
        self.trace_dir = Path(output_dir) / trace_name
        self.trace_name = trace_name
        self.wait_steps, self.warmup_steps, self.active_steps = wait_steps, warmup_steps, active_steps
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = torch.device(device)
        self.run_info = dict(run_info or {})
        # The number the run's log gives the tracer's step 0 (run.json counts from 0 at the tracer's start; the log
        # from 1 at the run's, a resumed run's from its checkpoint): the messages use the log's numbers
        self.first_log_step = first_log_step
        self.first_traced_step = wait_steps + warmup_steps
        self.traced_steps = list(range(self.first_traced_step, self.first_traced_step + active_steps))
        self.last_timed_step = self.traced_steps[-1] + after_steps
        self.host_path = self.trace_dir / host_trace_name(rank)
        self.device_path = self.trace_dir / device_trace_name(rank)
        self.stacks_path = self.trace_dir / STACKS_TABLE.format(rank=rank)
        self.use_cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._observer: ExecutionTraceObserver | None = None
        self._profiler: profile | None = None
        self._finalized = False
        self._device_trace_written = False
        self._write_error: str | None = None  # why the window's files could not be written (a full disk)
        # Rank 0's lock of the trace folder: the one claim_trace_dir holds for it in this process, else its own
        self._lock_claimed = rank == 0 and self.trace_dir.resolve() in _CLAIMED_TRACE_DIRS
        self._lock = (_CLAIMED_TRACE_DIRS[self.trace_dir.resolve()] if self._lock_claimed
                      else TraceDirLock(self.trace_dir) if rank == 0 else None)
        # Whether the window was published or discarded (after the last timed step, or when the run ended before),
        # and the error lines that left (empty when all went well)
        self._concluded = False
        self._publication: list[str] | None = None
        self._step = 0                      # optimizer steps completed so far (= the profiler's step_num)
        # Every clock read when the step now running began (None once no later step is timed), and what each timed
        # step took on them: the traced steps, and the steps before the profiler's window and the after_steps after it
        self._step_clocks: StepClocks | None = None
        self.traced = StepMeasures()
        self.untraced = StepMeasures()
        self.ranks_on_machine = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        self.heap_reserved_bytes = 0  # heap faulted in before the window (utils/host_memory.py)
        # The end of the step after which that is done (before the profiler opens the next step): before the last
        # warmup step, which is not timed, so a rank that took longer to do it is waited for there, not in a traced
        # step
        self._reserve_heap_after = max(1, self.first_traced_step - (1 if warmup_steps else 0))
        self.recording_cost_per_op_us: float | None = None  # measured on this machine before the window (CPU runs)
        # How long an all-reduce issued after compute waits to start, for a core (multi-rank CPU runs on gloo;
        # utils/collective_start.py), measured before the window
        self.collective_start_wait_s: float | None = None
        # How much more CPU compute takes after the thread was idle, by the pause (multi-rank CPU runs, whose
        # training thread waits for the network; utils/wake_cost.py), measured before the window
        self.wake_cost: dict[str, Any] | None = None
        self._load_start = None                                   # machine load when the traced steps began
        self.machine_load: dict[str, Any] | None = None
        self.files: dict[str, Path] = {}
        self._ranks_lost = False  # a collective of the tracer's failed: another rank is gone

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> ChakraTracer:
        try:
            self._start()
        except BaseException:
            self._release_lock()
            raise
        logger.info("rank %d: tracing steps %s of the log into %s (run.json's traced_steps %s, counted from 0 at the "
                    "tracer's start)", self.rank, self._log_steps(self.traced_steps), self.trace_dir,
                    self.traced_steps)
        self._step_clocks = StepClocks.read(self._now(sync=True))
        return self

    def _start(self) -> None:
        """Lock the trace folder, clean it, then open the profiler and observer."""
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        refusal = self._lock_trace_dir()
        self.run_id, refusal = self._agree_run_id(refusal)
        if refusal:  # before anything in the folder is touched: it holds another run's files
            raise TraceError(refusal)
        self._remove_stale_files()
        if not self.use_cuda:
            self.recording_cost_per_op_us = measure_recording_cost_us()
            if self.world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
                started = time.perf_counter()
                self.collective_start_wait_s = measure_collective_start_wait_s()
                logger.info("rank %d: an all-reduce issued after compute waited %.2f ms on average to start (its "
                            "mean time beyond its fastest; measured in %.1f s)", self.rank,
                            self.collective_start_wait_s * 1000, time.perf_counter() - started)
                started = time.perf_counter()
                self.wake_cost = measure_wake_cost_s()
                logger.info("rank %d: compute after a %.0f ms pause took %.2f ms more CPU than back to back over its "
                            "first %.0f ms (utils/wake_cost.py; measured in %.1f s)", self.rank,
                            self.wake_cost["pauses_s"][-1] * 1000, self.wake_cost["extra_cpu_s"][-1][-1] * 1000,
                            self.wake_cost["compute_s"][-1] * 1000, time.perf_counter() - started)
                # Each rank's probe takes its own time (3.5-4.5 s, 0.5 s apart on a loaded 2-core VM): without this
                # the rank done first waits for the other at the first step's all-reduce, inside that step's clocks
                self._wait_for_every_rank()
        self._observer = ExecutionTraceObserver()
        self._observer.register_callback(str(self._partial(self.host_path)))
        if not self._observer.is_registered:
            raise TraceError(f"{self.host_path}: could not register the ExecutionTraceObserver "
                             f"(another observer already registered in this process?)")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.use_cuda else [])
        # No record_shapes: the observer writes every input's shape already, and Kineto's shape recording keeps
        # the step's tensors from being freed until the window closes (GPT-2 124M on CPU: +650 MB of resident
        # memory a traced step, every allocation on fresh pages the kernel must zero: traced steps 1.07-1.47x the
        # untraced ones at 1 Gbit/s, without it 0.99-1.06x). Chakra's recipe turns it on; its linker does not read it.
        try:
            self._profiler = profile(
                activities=activities,
                schedule=schedule(wait=self.wait_steps, warmup=self.warmup_steps, active=self.active_steps,
                                  repeat=1),
                on_trace_ready=self._export_device_trace,
                execution_trace_observer=self._observer,
                **cuda_sync_events_config(self.use_cuda),
            )
            self._mark_run_identity()
            if self.first_traced_step == 0:
                self._load_start = sample_machine_load()  # before the first traced step's annotation opens
            self._profiler.__enter__()
        except BaseException:
            self._observer.unregister_callback()
            self._observer = self._profiler = None
            self._discard_traces()
            raise

    def _log_step(self, step: int) -> int:
        """The log's number of the tracer's step `step`."""
        return self.first_log_step + step

    def _log_steps(self, steps: list[int]) -> str:
        """The log's numbers of consecutive tracer steps: '7-9', or '7' for one."""
        first, last = self._log_step(steps[0]), self._log_step(steps[-1])
        return f"{first}-{last}" if last != first else str(first)

    def start_step(self, after_own_work: bool = False) -> None:
        """The coming optimizer step begins now: restart its clocks, which step() started when the last step ended.
        A caller that does work of its own between two steps (a loss read, a log line, an evaluation, a checkpoint)
        calls this after it, so that work is in no timed step: a checkpoint saved after step 2 took the next
        untraced step from 17 to 102 ms in a 2-rank GPT-2 tiny run. It does not take that work out of a traced
        step's trace: the profiler records whatever runs between two traced steps (inside_traced_steps()).

        Args:
            after_own_work: the caller did such work since step(). Rank 0's share of it (the log line, the metric
                sinks) is its own, so the ranks then meet before an untraced step's clocks start, as they do after
                the tracer's own work; not before a traced step, whose trace would record the barrier.
        """
        if self._step_clocks is None:
            return
        if after_own_work and not self.inside_traced_steps():
            self._start_next_step_together()
        self._step_clocks = StepClocks.read(self._now(sync=True))

    def inside_traced_steps(self) -> bool:
        """Whether the profiler records what runs now, between two steps: after step() ended the warm-up step or a
        traced step that is not the last, the host and device traces take it as part of the next traced step."""
        return self.first_traced_step <= self._step <= self.traced_steps[-1]

    def step(self, micro_batches: int | None = None) -> tuple[float, float]:
        """Mark the end of one optimizer step; call exactly once per optimizer step on every rank, with the
        micro-batches it took when the caller knows them. Returns the wall and CPU seconds this call spent on the
        tracer's own work (the heap reserved before the window, the traces exported after the last traced step, the
        window published after the last timed step; 0 otherwise): not the training's, for a caller that reports its
        pace (the export had been counted as the last traced step's time: 354.6 ms/step for a 39 ms step)."""
        step = self._step
        timed = step <= self.last_timed_step
        if step in self.traced_steps:
            self._record_step(step, self.traced, micro_batches)
        elif step < self.wait_steps or self.traced_steps[-1] < step <= self.last_timed_step:
            self._record_step(step, self.untraced, micro_batches)
        self._step += 1
        preparation = 0.0, 0.0
        if self._step == self._reserve_heap_after and self._step <= self.first_traced_step:
            started = time.perf_counter(), time.process_time()
            self.heap_reserved_bytes, line = reserve_heap_for_profiler()
            logger.info("rank %d: %s (%.1f s)", self.rank, line, time.perf_counter() - started[0])
            self._start_next_step_together()
            preparation = time.perf_counter() - started[0], time.process_time() - started[1]
        if self._step == self.first_traced_step:
            # Before profiler.step() opens the step's annotation: the probe reads every process's /proc entry (2-7
            # ms on a 2-core machine), time that would count as the traced step's own between its operators
            self._load_start = sample_machine_load()
        if self._profiler is not None and not self._finalized:
            window_ends = self._step >= self.traced_steps[-1] + 1
            started = (time.perf_counter(), time.process_time()) if window_ends else None
            self._profiler.step()  # after the last traced step, the profiler's own trace handler runs in it
            if started is not None:
                self._finalize_capture()
                self._start_next_step_together()
                preparation = (preparation[0] + time.perf_counter() - started[0],
                               preparation[1] + time.process_time() - started[1])
        # Past the last timed step the clocks are not read again: the rest of the run pays nothing for them
        self._step_clocks = StepClocks.read(self._now(sync=timed)) if self._step <= self.last_timed_step else None
        if self._step == self.last_timed_step + 1 and not self._concluded:
            # Every rank is here at the same step, so the ranks agree to publish now, not when the run ends: a
            # crash, kill or non-finite loss thousands of steps later had lost a window complete long before
            started = time.perf_counter(), time.process_time()
            try:
                self._publication = self._conclude(failed=False, lost=False)
            except BaseException:
                self._discard_traces()  # a rank lost in the ranks' agreement, a second Ctrl-C: no .partial left
                raise
            finally:
                self._release_lock()
            preparation = (preparation[0] + time.perf_counter() - started[0],
                           preparation[1] + time.process_time() - started[1])
        return preparation

    def _start_next_step_together(self) -> None:
        """Wait here for every rank after the tracer's own work between two steps (the heap reserved before the
        window, the window's traces exported after it), which takes each rank its own time. Without it a rank done
        first waits for the slowest at the next step's first collective, inside that step's clocks: in a 2-rank
        GPT-2 tiny run, the first untraced step after the window took one rank 499 ms instead of 68, and with
        one timed step after the window that was its untraced step in run.json."""
        self._wait_for_every_rank()

    def _wait_for_every_rank(self) -> None:
        """A barrier of every rank (nothing in a one-process run)."""
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.barrier(device_ids=[self.device.index] if self.use_cuda and self.device.index is not None else None)

    def _record_step(self, step: int, measures: StepMeasures, micro_batches: int | None) -> None:
        """What the step that just ended took on each clock read when it began, and how many micro-batches."""
        if self._step_clocks is not None:
            measures.add(step, self._step_clocks, StepClocks.read(self._now(sync=True)))
            if micro_batches is not None:
                measures.micro_batches[step] = micro_batches

    def _warn_of_unequal_steps(self) -> None:
        """The timed steps are compared with one another (the untraced pace with the traced steps'): say so when
        they did not all take the same micro-batches."""
        taken = {**self.untraced.micro_batches, **self.traced.micro_batches}
        if len(set(taken.values())) > 1:
            most = max(taken.values())
            # numbered as the log numbers them (they had been the tracer's, one less), the traced ones said so
            fewer = ", ".join(f"{self._log_step(step)} ({n}{', traced' if step in self.traced.micro_batches else ''})"
                              for step, n in sorted(taken.items()) if n < most)
            logger.warning("rank %d: --gradient-accumulation-steps %d: the timed steps %s of the log took fewer "
                           "micro-batches, "
                           "as an epoch's last step takes the batches left: run.json's times compare unequal steps "
                           "(step_micro_batches); choose a --gradient-accumulation-steps that divides the batches of "
                           "an epoch", self.rank, most, fewer)

    def _note_machine_load(self) -> None:
        """What else ran on the machine during the traced steps (run.json); a warning when it was busy."""
        self.machine_load = machine_load_between(self._load_start, sample_machine_load())
        warning = busy_machine_warning(self.machine_load)
        if warning:
            logger.warning("rank %d: %s", self.rank, warning)

    def __exit__(self, exc_type, exc_val, exc_tb) -> bool:
        """The window was published after the last timed step (step()): raise what went wrong then, on a clean
        exit. A run that ended before: publish a whole window (its after-steps cut short), or remove a window cut
        short. False, so that an exception of the run goes on."""
        failed = exc_type is not None
        try:
            if not self._concluded:
                self._publication = self._conclude(failed=failed, lost=is_lost_peer_error(exc_val))
        finally:
            self._release_lock()
        errors = self._publication or []
        if failed:
            for error in errors:
                logger.error("rank %d: %s", self.rank, error)
        elif errors:
            raise TraceError("; ".join(errors))
        return False

    def _conclude(self, failed: bool, lost: bool) -> list[str]:
        """Publish a whole window's files and write run.json, or say why nothing was written; the error lines.

        Args:
            failed: this rank is leaving the run by an exception.
            lost: that exception is a collective of a rank that is gone (is_lost_peer_error).
        """
        self._concluded = True  # once, whatever interrupts it
        traced = [s for s in self.traced_steps if s in self.traced.wall_time_s]
        if len(traced) < self.active_steps:
            # The flags parser refuses a --max-steps shorter than the window, so this is a run stopped early (a
            # signal, an error). A window cut short is not the trace asked for and must not replace the one in place:
            # stop the profiler without exporting it (a second Ctrl-C came during an export to be thrown away, and
            # left its .partial files), remove its files whatever interrupts this, and leave the exit status alone.
            try:
                self._finalize_capture(export=False)
            finally:
                self._discard_traces()
            if traced:
                logger.warning("%s: no trace written: the trace window (steps %s) was cut short after step %d (the "
                               "run ended at step %d); its partial files were removed and the folder left as it was",
                               self.trace_dir, self._log_steps(self.traced_steps), self._log_step(traced[-1]),
                               self._log_step(self._step - 1))
            else:
                logger.warning("%s: no trace written: the run ended at step %d, before the first traced step, %d "
                               "(after wait %d + warmup %d)", self.trace_dir, self._log_step(self._step - 1),
                               self._log_step(self.first_traced_step), self.wait_steps, self.warmup_steps)
            return []
        self._finalize_capture()
        self._warn_of_unequal_steps()
        completed: list[int] = []
        refusal = self._agree_to_publish(failed, lost)
        if refusal is None:
            completed = traced
            errors = self._publish_traces()
        else:
            self._discard_traces()
            errors = [refusal]
        # A rank that raised cannot count on the others joining a collective, so only gather on a clean exit.
        ranks = self._gather_rank_reports(errors, completed, gather=not failed and not self._ranks_lost)
        failing = [e for r in ranks for e in r["errors"]]
        if self.rank == 0 and completed and not failing:
            try:
                self._write_run_json(completed, ranks)
            except OSError as exc:
                errors.append(write_failure(self.trace_dir, exc))
        if errors or failed:
            return errors
        return ["run.json not written: " + "; ".join(failing)] if failing else []

    # ---- capture ---------------------------------------------------------------------------------------------
    def _finalize_capture(self, export: bool = True) -> None:
        """Stop the profiler and finalise the host trace, once; without `export`, a window still open is not
        exported (its files are to be removed)."""
        if self._finalized:
            return
        self._finalized = True
        if self._profiler is not None:
            if not export:
                self._profiler.on_trace_ready = None
            # Runs the schedule's exit action: stops a window still open (exporting what it recorded) and
            # lets the profiler release the observer.
            self._profiler.__exit__(None, None, None)
        if self._observer is not None:
            # Finalises the host JSON; both calls are no-ops if the profiler already released the observer.
            self._observer.stop()
            self._observer.unregister_callback()
            self._remove_empty_resources_dir()
        # The profiler holds every recorded event: free them now
        # rather than for the rest of the run.
        self._profiler = None
        self._observer = None

    def _export_device_trace(self, prof: profile) -> None:
        """on_trace_ready: the Kineto trace and the key_averages table of the recorded window. The machine's load
        is sampled first: the last traced step's annotation has closed by now, so the probe's time is in none."""
        if self._load_start is not None and self.machine_load is None:
            self._note_machine_load()
        # A write error (a full disk) is kept for __exit__, which reports it once the profiler is closed: raised
        # here, inside the profiler's step, it would leave the profiler and observer half stopped
        try:
            prof.export_chrome_trace(str(self._partial(self.device_path)))
            self._device_trace_written = True
            sort_by = stacks_sort_key(self.use_cuda)
            table = prof.key_averages().table(sort_by=sort_by, row_limit=-1)
            # whole under its .partial name or not at all, so a cut-short table is never published
            write_text_atomic(self._partial(self.stacks_path), f"# {self.trace_name} rank {self.rank}: optimizer "
                              f"steps {self.traced_steps}, sorted by {sort_by}\n{table}\n")
        except OSError as exc:
            self._write_error = write_failure(self.trace_dir, exc)

    # ---- files -----------------------------------------------------------------------------------------------
    def _agree_to_publish(self, failed: bool, lost: bool = False) -> str | None:
        """Why this rank must not publish its window (None: it publishes). The ranks publish all or none, so the
        folder never holds some ranks' new traces beside others' old ones (a 2-rank run whose rank 0 was killed
        while it exported had left rank 1's new files beside rank 0's old ones, and the earlier run's rank 1 in
        .previous, which the next run removed). Several ranks first agree in a collective that a rank gone never
        joins (the others stop in it, or are stopped by torchrun); a rank that failed after the window does not
        publish, since the others may not (the window is published after the last timed step, where all ranks are,
        so this rank failed in the untraced steps timed after the window). When all agree, the generation before the
        one in place leaves .previous/<name>/ (local rank 0), which then takes the one in place
        (_move_previous_run_aside)."""
        distributed = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        if lost and distributed:
            self._ranks_lost = True
            return (f"{self.trace_dir}: no trace written: another rank was lost after the trace window, before the "
                    "ranks published it; the folder keeps the earlier run's files")
        if failed and distributed:
            return (f"{self.trace_dir}: no trace written: this rank failed after the trace window, and the other "
                    "ranks cannot know to publish theirs; the folder keeps the earlier run's files")
        if distributed:
            ready: list[Any] = [None] * self.world_size
            try:
                dist.all_gather_object(ready, self._write_error is None)
            except Exception as exc:  # a rank gone: gloo's connection closed
                self._ranks_lost = True
                return (f"{self.trace_dir}: no trace written: the ranks could not agree to publish the trace window "
                        f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); the folder keeps the "
                        "earlier run's files")
            unable = [rank for rank, ok in enumerate(ready) if not ok]
            if self._write_error is not None:
                return f"{self._write_error}; no trace written, the folder's earlier files left in place"
            if unable:
                return (f"{self.trace_dir}: no trace written: rank(s) {', '.join(map(str, unable))} could not write "
                        "their trace window; the folder keeps the earlier run's files")
        if self._write_error is None and self.local_rank == 0:
            shutil.rmtree(self._previous_dir(), ignore_errors=True)
        if distributed:
            self._wait_for_every_rank()  # the older generation is gone before any rank moves its files there
        return None

    def _publish_traces(self) -> list[str]:
        """Validate this rank's new files; unless they could not be written (a full disk: then all are removed and
        the previous run's stay), move the previous run's files of this rank aside and rename the new ones into
        place, an invalid one as <name>.invalid. Returns error lines (empty when all is well)."""
        traces = ((self.host_path, "host"), (self.device_path, "device"))
        problems = {kind: self._check_partial(path, kind) for path, kind in traces}
        broken = [f"{path.name}: {problems[kind]}" for path, kind in traces if problems[kind]]
        if self._write_error is None and broken and folder_is_full(self.trace_dir):
            self._write_error = (f"{self.trace_dir}: the file system is full ({'; '.join(broken)}); free space or "
                                 "choose another --trace-output-dir")
        if self._write_error is not None:
            self._discard_traces()
            return [f"{self._write_error}; no trace written, the folder's earlier files left in place"]
        self._move_previous_run_aside()
        errors = []
        for path, kind in traces:
            partial = self._partial(path)
            if problems[kind] is None:
                partial.replace(path)
                self.files[kind] = path
            elif partial.exists():
                partial.replace(path.with_name(path.name + INVALID_SUFFIX))
                errors.append(f"{path}: {problems[kind]} (kept as {path.name}{INVALID_SUFFIX})")
            else:
                errors.append(f"{path}: {problems[kind]}")
        resources = self._resources_dir(self._partial(self.host_path))
        if resources.is_dir():
            resources.replace(self._resources_dir(self.host_path))
        stacks = self._partial(self.stacks_path)
        if stacks.exists():
            stacks.replace(self.stacks_path)
            self.files["stacks"] = self.stacks_path
        return errors

    def _check_partial(self, path: Path, kind: str) -> str | None:
        """The problem of this rank's new `kind` trace (still under its hidden .partial name), or None."""
        partial = self._partial(path)
        if kind == "device" and not self._device_trace_written:
            return "the profiler never exported a device trace"
        if not partial.exists():
            return "the ExecutionTraceObserver wrote no file" if kind == "host" else "the profiler wrote no file"
        document, problem = read_trace_file(partial, kind)
        if not problem and kind == "host" and self.world_size > 1 and not any(
                node.get("name") == PG_INIT_NODE for node in document["nodes"]):
            logger.warning("%s: no '%s' node: the process group was not initialised when the trace window began, so "
                           "the conversion cannot place this rank's collectives", path, PG_INIT_NODE)
        return problem

    def _discard_traces(self) -> None:
        """Remove this rank's files of the window, whole or half-written (Kineto's export leaves <file>.tmp)."""
        for path in (self.host_path, self.device_path, self.stacks_path):
            self._partial(path).unlink(missing_ok=True)
            self._partial(path).with_name(self._partial(path).name + ".tmp").unlink(missing_ok=True)
        shutil.rmtree(self._resources_dir(self._partial(self.host_path)), ignore_errors=True)

    def _remove_stale_files(self) -> None:
        """Remove what killed runs left half-written (hidden .partial files of this rank; rank 0 also those of ranks
        beyond this world size). The previous run's files stay where they are, and the one before it in .previous,
        until every rank's window is written (_agree_to_publish, _move_previous_run_aside)."""
        self._discard_traces()
        if self.rank != 0:
            return
        for path in self.trace_dir.iterdir():
            rank = self._rank_of(path.name)
            if path.name.startswith(".") and path.name.endswith((PARTIAL_SUFFIX, PARTIAL_SUFFIX + ".tmp")) \
                    and rank is not None and rank >= self.world_size:
                path.unlink(missing_ok=True)

    def _previous_dir(self) -> Path:
        """<trace-output-dir>/.previous/<name>/, which __enter__ removes: refused unless it is a folder right inside
        that .previous (never the run's own folder, nor one outside the trace output folder)."""
        previous_runs = self.trace_dir.parent / PREVIOUS_RUN_DIR
        folder = previous_runs / self.trace_name
        if folder.parent != previous_runs or folder.resolve().parent != previous_runs.resolve():
            raise TraceError(f"trace name {self.trace_name!r}: {folder} is not inside {previous_runs}")
        return folder

    @staticmethod
    def _rank_of(name: str) -> int | None:
        """The rank a file of a run belongs to: host.<r>.json[.gz|.invalid], device.<r>..., stacks.<r>.txt,
        host.<r>_resources, <name>.<r>.et, <name>.<r>.merged.json, report_timeline_rank<r>.png; else None."""
        parts = name.lstrip(".").split(".")
        if len(parts) >= 2 and parts[0] in ("host", "device", "stacks"):
            digits = parts[1].split("_")[0]
            return int(digits) if digits.isdigit() else None
        if name.endswith(".et") and len(parts) >= 3 and parts[-2].isdigit():
            return int(parts[-2])
        if name.endswith(".merged.json") and len(parts) >= 4 and parts[-3].isdigit():
            return int(parts[-3])
        if name.startswith("report_timeline_rank") and name.endswith(".png"):
            digits = name[len("report_timeline_rank"):-len(".png")]
            return int(digits) if digits.isdigit() else None
        return None

    def _move_previous_run_aside(self) -> None:
        """Once this run's window is written: move the files of the run it replaces (this rank's traces, .et and
        merged JSON; on rank 0 also run.json, the summary, the report and ranks beyond this world size) into
        <trace-output-dir>/.previous/<name>/, so the folder never mixes two runs and the old one is not lost."""
        moved = []
        for path in sorted(self.trace_dir.iterdir()):
            if path.name.startswith("."):
                continue
            rank = self._rank_of(path.name)
            mine = rank == self.rank or (self.rank == 0 and rank is not None and rank >= self.world_size)
            derived = self.rank == 0 and rank is None and derived_file(path.name)
            if not (mine or derived):
                continue
            target = self._previous_dir() / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            path.replace(target)
            moved.append(path.name)
        if moved:
            logger.info("rank %d: the previous run's %s moved to %s", self.rank, ", ".join(moved),
                        self._previous_dir())

    def _lock_trace_dir(self) -> str | None:
        """Rank 0 locks the trace folder for this run, unless claim_trace_dir holds it already; why it could not
        (another run traces into it), or None."""
        if self._lock is None or self._lock_claimed:
            return None
        return take_trace_dir_lock(self._lock)

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def _agree_run_id(self, refusal: str | None = None) -> tuple[str, str | None]:
        """One id for the whole run, and rank 0's refusal to trace (None when it may): rank 0's, given to every rank
        (the id marks each device trace and run.json)."""
        run_id = f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:12]}"
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            box = [run_id, refusal]
            dist.broadcast_object_list(box, src=0, device=self.device if self.use_cuda else None)
            run_id, refusal = box
        return run_id, refusal

    def _mark_run_identity(self) -> None:
        """Write the run id, rank and world size into the device trace's metadata when it is exported."""
        mark = getattr(self._profiler, "preset_metadata_json", None)
        if mark is not None:  # torch >= 2.2
            mark(RUN_METADATA_KEY, json.dumps({"id": self.run_id, "rank": self.rank, "world_size": self.world_size}))

    def _remove_empty_resources_dir(self) -> None:
        # torch 2.4's unregister_callback always creates "<trace>_resources" beside the trace for inductor kernels.
        resources = self._resources_dir(self._partial(self.host_path))
        if resources.is_dir() and not any(resources.iterdir()):
            resources.rmdir()

    @staticmethod
    def _resources_dir(host_trace: Path) -> Path:
        """Where ExecutionTraceObserver keeps compiled kernels of a trace (os.path.splitext(name)[0] + _resources)."""
        return host_trace.with_name(os.path.splitext(host_trace.name)[0] + "_resources")

    @staticmethod
    def _partial(path: Path) -> Path:
        return path.with_name("." + path.name + PARTIAL_SUFFIX)

    # ---- run.json --------------------------------------------------------------------------------------------
    def _now(self, sync: bool) -> float:
        if sync and self.use_cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _gather_rank_reports(self, errors: list[str], completed: list[int], gather: bool) -> list[dict[str, Any]]:
        report = {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "hostname": socket.gethostname(),
            "device": str(self.device),
            "device_name": device_name(self.device),
            # Threads an op may run on (torch's intra-op pool): with one, every op runs on the training thread
            # alone, so its CPU time is what the ops cost (trace_tools.step_timing)
            "intra_op_threads": torch.get_num_threads(),
            # Each clock's times in the traced steps (step_...) and in the untraced ones (untraced_step_..., numbered
            # by run.json's untraced_steps), in step order; StepMeasures says what each clock is
            **self.traced.report("step_"),
            **self.untraced.report("untraced_step_"),
            "machine_load": self.machine_load,
            "ranks_on_machine": self.ranks_on_machine,
            "heap_reserved_bytes": self.heap_reserved_bytes,
            "recording_cost_per_op_us": self.recording_cost_per_op_us,
            "collective_start_wait_s": self.collective_start_wait_s,
            "wake_cost": self.wake_cost,
            "files": {kind: path.name for kind, path in sorted(self.files.items())},
            "errors": errors,
        }
        if not (gather and self.world_size > 1 and dist.is_available() and dist.is_initialized()):
            return [report]
        reports: list[Any] = [None] * self.world_size
        dist.all_gather_object(reports, report)
        return reports

    def _write_run_json(self, completed: list[int], ranks: list[dict[str, Any]]) -> None:
        times = [r["step_wall_time_s"] for r in ranks]
        info = {
            "trace_name": self.trace_name,
            "run_id": self.run_id,
            **self.run_info,
            "world_size": self.world_size,
            "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": software_versions(),
            "schedule": {"wait": self.wait_steps, "warmup": self.warmup_steps, "active": self.active_steps},
            # Step n is the optimizer step counted from 0 at the tracer's start; both traces mark it ProfilerStep#n.
            # The log numbers it first_log_step + n (from 1 at the run's start, past 1 in a resumed run: resumed_from)
            "first_log_step": self.first_log_step,
            "traced_steps": completed,
            "step_annotation": STEP_ANNOTATION.format(step="<n>"),
            "ranks_gathered": len(ranks),
            "ranks": [{k: v for k, v in r.items() if k != "errors"} for r in ranks],
            # The slowest rank sets each step's time in a synchronous data-parallel job.
            "step_wall_time_s_max": [max(t[i] for t in times) for i in range(len(completed))] if times else [],
            "untraced_steps": sorted(self.untraced.wall_time_s),
            "machine_busy": any((r.get("machine_load") or {}).get("busy") for r in ranks),
        }
        write_text_atomic(self.trace_dir / RUN_INFO, json.dumps(info, indent=2, default=str) + "\n")
        logger.info("traces of steps %s of the log from %d rank(s) in %s", self._log_steps(completed), len(ranks),
                    self.trace_dir)


class TraceDirLock(SaveDirLock):
    """One traced run at a time in a trace folder: the --save-dir lock (utils/checkpointing.py) on
    <trace folder>/.tracing.lock, so a second run is refused before it touches the first one's files."""

    LOCK_NAME = TRACE_LOCK_FILE
    FOLDER = "{folder}"
    ACTIVITY = "is tracing into this folder"
    CHOICES = "another --trace-name or --trace-output-dir"


def folder_is_full(folder: Path) -> bool:
    """Whether the file system holding `folder` has less than FULL_FOLDER_BYTES left for this user."""
    try:
        return shutil.disk_usage(folder).free < FULL_FOLDER_BYTES
    except OSError:
        return False


def write_failure(folder: Path, exc: OSError) -> str:
    """One line for a file of the trace folder `folder` that could not be written: a full disk named as such."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{folder}: the file system is full ({exc.strerror}); free space or choose another --trace-output-dir"
    return f"{exc.filename or folder}: could not be written ({exc.strerror or exc})"


@dataclass(frozen=True)
class StepClocks:
    """Every clock a step is timed on, read at one moment; None where this machine does not provide that clock."""

    wall_s: float
    process_cpu_s: float
    training_thread_cpu_s: float
    run_queue_wait_s: float | None
    communication_s: tuple[float, float] | None  # gloo's threads: (on a CPU, runnable but waiting for one)
    page_faults: int | None
    interrupt_cpu_s: float | None

    @classmethod
    def read(cls, wall_s: float) -> StepClocks:
        """The clocks now, beside a wall time the caller read (after a device sync, on a GPU)."""
        return cls(wall_s, time.process_time(), time.thread_time(), run_queue_wait_s(),
                   communication_threads_times_s(), thread_page_faults(), interrupt_cpu_seconds())


@dataclass
class StepMeasures:
    """What each timed step took on each clock, by step number; run.json names each list after its field. A clock
    the machine does not provide (not Linux, no gloo threads) leaves its field empty."""

    wall_time_s: dict[int, float] = field(default_factory=dict)
    # Micro-batches the step took (--gradient-accumulation-steps, fewer in an epoch's last step), where the caller
    # said
    micro_batches: dict[int, int] = field(default_factory=dict)
    # CPU time of the whole process: what recording costs, whatever the network made it wait
    cpu_time_s: dict[int, float] = field(default_factory=dict)
    # CPU time of the training thread alone (the one calling step()): the rest of the process's is its other
    # threads' (gloo's TCP loop on a CPU run), work that shares the cores with the compute
    thread_cpu_time_s: dict[int, float] = field(default_factory=dict)
    # Time the training thread was ready to run but waited for a core that another thread or process had: inside
    # its ops' durations, and a property of the machine, not of the program
    run_queue_wait_s: dict[int, float] = field(default_factory=dict)
    # CPU time of the communication backend's own threads (gloo's TCP loop and workers): the collectives' CPU work,
    # which a CPU run does on the cores its compute needs. Not measured on a GPU run: NCCL's work is the device's
    communication_cpu_time_s: dict[int, float] = field(default_factory=dict)
    # Time those threads were ready to run but waited for a core (the training threads had them): the collectives'
    # results reach the training thread that much later, whatever the network
    communication_run_queue_wait_s: dict[int, float] = field(default_factory=dict)
    # Minor page faults of the training thread: a step that reuses the memory the last one freed has none
    page_faults: dict[int, int] = field(default_factory=dict)
    # The machine's time in interrupt and softirq context, all its CPUs, counted in clock ticks of 10 ms
    # (utils/metrics.py): on a CPU run mostly the kernel's processing of the collectives' packets; shared by the
    # ranks on this machine (ranks_on_machine). A kernel without CONFIG_IRQ_TIME_ACCOUNTING also counts it in the
    # CPU time of the threads it interrupted
    interrupt_cpu_time_s: dict[int, float] = field(default_factory=dict)

    def add(self, step: int, start: StepClocks, end: StepClocks) -> None:
        """Step `step` began at `start` and ended at `end`."""
        self.wall_time_s[step] = end.wall_s - start.wall_s
        self.cpu_time_s[step] = end.process_cpu_s - start.process_cpu_s
        self.thread_cpu_time_s[step] = end.training_thread_cpu_s - start.training_thread_cpu_s
        if start.run_queue_wait_s is not None and end.run_queue_wait_s is not None:
            self.run_queue_wait_s[step] = end.run_queue_wait_s - start.run_queue_wait_s
        if start.communication_s is not None and end.communication_s is not None:
            # A thread that ended within the step takes its time with it: never below zero
            self.communication_cpu_time_s[step] = max(0.0, end.communication_s[0] - start.communication_s[0])
            self.communication_run_queue_wait_s[step] = max(0.0, end.communication_s[1] - start.communication_s[1])
        if start.page_faults is not None and end.page_faults is not None:
            self.page_faults[step] = end.page_faults - start.page_faults
        if start.interrupt_cpu_s is not None and end.interrupt_cpu_s is not None:
            self.interrupt_cpu_time_s[step] = end.interrupt_cpu_s - start.interrupt_cpu_s

    def report(self, prefix: str) -> dict[str, list[float]]:
        """run.json's lists, `prefix` + "wall_time_s" and so on, each in step order."""
        return {prefix + name: [measured[step] for step in sorted(measured)] for name, measured in vars(self).items()}


def run_queue_wait_s() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU since it started (Linux's
    /proc/thread-self/schedstat); None where the kernel does not provide it."""
    times = schedstat_seconds("/proc/thread-self/schedstat")
    return times[1] if times is not None else None


def thread_page_faults() -> int | None:
    """Minor page faults of the calling thread since it started (getrusage(RUSAGE_THREAD)); None where the system
    does not count them per thread (not Linux: no RUSAGE_THREAD)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return None
    return resource.getrusage(who).ru_minflt


# Names Linux shows for the threads of torch's gloo backend (/proc/<pid>/task/<tid>/comm): the TCP transport's
# event loop, which moves the bytes, and the process group's workers, which run the collectives' reductions.
COMMUNICATION_THREAD_NAMES = ("gloo_tcp_loop", "pt_gloo_runloop")


def communication_threads_times_s() -> tuple[float, float] | None:
    """Seconds the process's communication threads (COMMUNICATION_THREAD_NAMES) have spent on a CPU, and runnable
    but waiting for one, since they started (each thread's /proc/self/task/<tid>/schedstat, summed over the
    threads); None where Linux does not provide it or no such thread exists (before the process group starts, or a
    backend without CPU threads such as NCCL)."""
    fields = communication_threads_schedstat()
    return (fields[0] / 1e9, fields[1] / 1e9) if fields else None


def communication_threads_schedstat() -> tuple[int, int, int] | None:
    """The communication threads' schedstat fields summed over the threads: ns on a CPU, ns runnable but waiting
    for one, and times given a CPU (a thread sleeping on its sockets gets one each time the kernel wakes it); None
    where Linux does not provide them or no such thread exists."""
    counted = [fields for fields in (schedstat_fields(f"/proc/self/task/{tid}/schedstat")
                                     for tid in communication_thread_ids()) if fields]  # None: the thread ended
    return tuple(sum(column) for column in zip(*counted)) if counted else None


def communication_thread_ids() -> list[str]:
    """The ids of the process's threads named COMMUNICATION_THREAD_NAMES (/proc/self/task/<tid>/comm); none where
    Linux does not show them."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    ids = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as name:
                if name.read().strip() in COMMUNICATION_THREAD_NAMES:
                    ids.append(tid)
        except OSError:
            continue  # the thread ended between the listing and the read
    return ids


def measure_recording_cost_us(calls: int = 300) -> float:
    """CPU time the recording adds to one operator on this machine, in µs: a small operator timed untraced and
    recorded as the window records (Kineto's CPU events and an ExecutionTraceObserver writing a file), the fastest of
    three rounds each. The recorder does the same work for every operator, whatever the operator computes; timed in
    a tight loop it is meant as a lower bound (training's operators cost it 1-4x as much), so the conversion takes at
    least this much out of each recorded op where it has no untraced CPU time of the thread that ran them, and
    otherwise the traced steps' extra CPU time. It moves between processes on one machine (6.5-16.1 µs on a 2-core
    VM), so it is no floor under that thread's own measurement (trace_tools.link.remove_recording_overhead)."""
    x = torch.ones(4)

    def per_call_us() -> float:
        rounds = []
        for _ in range(3):
            started = time.process_time()
            for _ in range(calls):
                torch.add(x, x)
            rounds.append((time.process_time() - started) / calls * 1e6)
        return min(rounds)

    plain = per_call_us()
    with tempfile.TemporaryDirectory() as folder:
        observer = ExecutionTraceObserver()
        observer.register_callback(os.path.join(folder, "calibration.json"))
        try:
            with profile(activities=[ProfilerActivity.CPU], execution_trace_observer=observer):
                recorded = per_call_us()
        finally:
            observer.unregister_callback()
    return max(0.0, recorded - plain)


def cuda_sync_events_config(on_cuda: bool) -> dict[str, Any]:
    """profile() keywords that record Kineto's CUDA synchronisation events (stream waits, event and stream syncs):
    what tells the conversion a real cross-stream wait from a coincidence. Empty on CPU and where this torch lacks
    the option (added in torch 2.4's successors)."""
    if not on_cuda:
        return {}
    try:
        from torch.profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(enable_cuda_sync_events=True)}
    except (ImportError, TypeError):
        return {}


def stacks_sort_key(on_cuda: bool) -> str:
    """key_averages() column stacks.<rank>.txt is sorted by: self device time on CUDA, else self CPU time."""
    if not on_cuda:
        return "self_cpu_time_total"
    # torch 2.4 renamed the CUDA columns to "device"; keep the old name for builds without it.
    has_device_column = hasattr(torch.autograd.profiler_util.FunctionEventAvg(), "self_device_time_total")
    return "self_device_time_total" if has_device_column else "self_cuda_time_total"


def device_name(device: torch.device) -> str:
    """Marketing name of a CUDA device, else the CPU model."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def software_versions() -> dict[str, Any]:
    versions: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": None,
        "nccl": None,
        "transformers": None,
    }
    if torch.cuda.is_available():
        versions["cudnn"] = torch.backends.cudnn.version()
        try:
            versions["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError, TypeError):
            pass
    transformers = sys.modules.get("transformers")
    if transformers is None:
        try:
            import transformers
        except ImportError:
            transformers = None
    if transformers is not None:
        versions["transformers"] = transformers.__version__
    return versions


def check_trace_file(path: str | os.PathLike, kind: str) -> str | None:
    """None if ``path`` holds exactly one JSON document shaped like a host or device trace, else the problem."""
    return read_trace_file(path, kind)[1]


def read_trace_file(path: str | os.PathLike, kind: str) -> tuple[Any, str | None]:
    """(document, None) if ``path`` holds exactly one JSON document shaped like a ``kind`` ("host" or "device")
    trace, else (None, the problem in words)."""
    if kind not in ("host", "device"):
        raise ValueError(f"unknown trace kind {kind!r}")
    data = Path(path).read_bytes()
    if not data.strip():
        return None, "empty file"
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError as e:  # in the converter's words: truncated, written twice, not JSON
        return None, describe_json_problem(data, e)
    if kind == "host":
        if not isinstance(document, dict) or not isinstance(document.get("nodes"), list) or "schema" not in document:
            return None, "not an execution trace (no 'schema' and 'nodes')"
        if not document["nodes"]:
            return None, "execution trace has no nodes"
    elif not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        return None, "not a Kineto trace (no 'traceEvents')"
    return document, None
