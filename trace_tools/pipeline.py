"""Convert runs: each rank's host + device trace to a validated .et, ranks in parallel, with a summary per run."""
from __future__ import annotations

import gc
import glob
import logging
import os
import re
import resource
import shutil
import signal
import stat
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from .atomic import atomic_path, folder_held
from .command_line import die_with_parent
from .convert import write_et, write_merged_json
from .core_sharing import share_cores
from .discover import Run
from .identity import device_header_identity, host_device_time_problem, one_run_problems, rank_identity
from .layout import CONVERSION_SUMMARY, PG_INIT_NODE, RUN_INFO, STEP_PREFIX, et_name, et_sets, made_from_et_files
from .link import GPU_OP, link_host_and_device, remove_recording_overhead
from .load import (PAST_WINDOW_END, UNUSABLE_TIME, TraceError, is_structural, load_device_trace, load_host_trace,
                   read_trace_bytes)
from .repair import NO_OPERATORS_PROBLEM
from .step_timing import (STEP_SPREAD_BOUND, MicroBatches, StepTimes, micro_batches_of, read_run_json, step_times_of,
                          untraced_steps_after_the_first)
from .summary import (RankResult, RunResult, converted_from, et_fingerprint, file_fingerprint,
                      read_previous_results, write_run_summary)
from .validate import collectives_agree, validate_et

logger = logging.getLogger(__name__)

MERGED_NAME = "{name}.{rank}.merged.json"
FALLBACK_OUTPUT_ROOT = Path("converted")


class OutputError(TraceError):
    """An output could not be written (disk full, read-only): the message names the output, not the input."""


UTF8_BOM = b"\xef\xbb\xbf"
# NaN and Infinity where a JSON value goes: Python's json.dump writes them, no JSON parser has to accept them.
# (PyTorch itself writes non-finite values as the strings "nan" and "inf".)
_NON_FINITE = re.compile(rb"([:\[,]\s*)(-?Infinity|NaN)(?=\s*[,\]}])")
# fix_host_traces.py appends a top-level "repair" member saying what it changed.
_REPAIR_MARK = re.compile(rb'"repair"\s*:\s*')
REPAIR_MARK_TAIL = 1 << 14


def read_trace_checked(path: str | Path, warnings: list[str]) -> bytes:
    """The trace's bytes, with what a JSON parser refuses but loses nothing taken out (a byte-order mark, NaN and
    Infinity, read as null), each said in `warnings`."""
    data = read_trace_bytes(path)
    if data.startswith(UTF8_BOM):
        data = data[len(UTF8_BOM):]
        warnings.append(f"{path}: starts with a UTF-8 byte-order mark (an editor or a Windows tool saved it; PyTorch "
                        "writes none): read without it")
    return data


def _without_non_finite(path: str | Path, data: bytes, warnings: list[str]) -> bytes | None:
    """data with bare NaN/Infinity values as null (None when there are none)."""
    count = 0

    def to_null(match: re.Match) -> bytes:
        nonlocal count
        count += 1
        return match.group(1) + b"null"

    fixed = _NON_FINITE.sub(to_null, data)
    if not count:
        return None
    warnings.append(f"{path}: {count} NaN/Infinity value(s), which are not JSON (PyTorch writes \"nan\"/\"inf\" "
                    "strings; another tool rewrote this file): read as null")
    return fixed


def load_host_checked(path: str | Path, warnings: list[str] | None = None, data: bytes | None = None):
    """load_host_trace(), with trace_tools.repair's diagnosis as the message when the file is broken, and a
    one-line error for a trace that holds no operator."""
    warnings = [] if warnings is None else warnings
    if data is None:
        data = read_trace_checked(path, warnings)
    try:
        host = load_host_trace(path, data=data)
    except TraceError as error:
        fixed = _without_non_finite(path, data, warnings)
        if fixed is not None:
            return load_host_checked(path, warnings, fixed)
        try:
            from .repair import diagnose_host_trace
            diagnosis = diagnose_host_trace(path)
        except Exception:  # the diagnosis is a better message, never a new failure
            raise error from None
        if diagnosis.ok:
            raise
        hint = "; run fix_host_traces.py" if diagnosis.repairable else ""
        raise TraceError(path, f"{diagnosis.problem}{hint}") from None
    operators = sum(1 for name in host.names if not is_structural(name) and name != PG_INIT_NODE)
    if not operators:
        raise TraceError(path, NO_OPERATORS_PROBLEM.format(nodes=len(host)))
    return host


def load_device_checked(path: str | Path, warnings: list[str], data: bytes):
    try:
        return load_device_trace(path, data=data)
    except TraceError:
        fixed = _without_non_finite(path, data, warnings)
        if fixed is None:
            raise
        return load_device_trace(path, data=fixed)


def host_repair_note(data: bytes) -> str:
    """What fix_host_traces.py changed in this host trace, from its "repair" member ("" when never repaired)."""
    import orjson

    tail_start = max(0, len(data) - REPAIR_MARK_TAIL)
    match = None
    for match in _REPAIR_MARK.finditer(data, tail_start):
        pass
    if match is None:
        return ""
    end = data.find(b"}", match.end())
    try:
        marker = orjson.loads(data[match.end():end + 1])
    except orjson.JSONDecodeError:
        return "repaired by fix_host_traces.py"
    if not isinstance(marker, dict):
        return "repaired by fix_host_traces.py"
    if marker.get("action"):
        return f"repaired by fix_host_traces.py: {marker['action']}"
    if marker.get("truncated"):
        dropped = f", {marker['dropped_bytes']} bytes dropped" if marker.get("dropped_bytes") else ""
        return f"repaired by fix_host_traces.py: truncated, {marker.get('kept_nodes', '?')} nodes kept{dropped}"
    return "repaired by fix_host_traces.py"


def input_fingerprints(host_path: str | Path, device_path: str | Path) -> dict[str, dict[str, Any]]:
    """What a rank's .et is made from: its host and device trace, and the run.json beside the host trace when there
    is one (its step times set the .et's durations)."""
    inputs = {"host": file_fingerprint(host_path), "device": file_fingerprint(device_path)}
    run_info = Path(host_path).parent / RUN_INFO
    if run_info.is_file():
        inputs["run_info"] = file_fingerprint(run_info)
    return inputs


def _step_names(names) -> list[str]:
    return sorted({n for n in names if n.startswith(STEP_PREFIX)}, key=lambda n: (len(n), n))


def convert_rank(host_path: str | Path, device_path: str | Path, out_path: str | Path, rank: int = 0,
                 merged_path: str | Path | None = None, validate: bool = True, run_name: str = "") -> RankResult:
    """Link one rank's traces, write the .et (and the merged JSON when asked), validate what was written.

    Returns the result with timings (load, link, write, validate) and node counts. Raises TraceError (one line,
    naming the file) for unusable inputs; nothing is left at out_path then.
    """
    # The cyclic garbage collector would rescan the growing heap of parsed nodes again and again (it triples the
    # time on a 55 MB trace); nothing built here holds reference cycles worth collecting.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _convert_rank(host_path, device_path, out_path, rank, merged_path, validate, run_name)
    finally:
        if was_enabled:
            gc.enable()


def _convert_rank(host_path, device_path, out_path, rank, merged_path, validate, run_name) -> RankResult:
    result = RankResult(run=run_name, rank=rank)
    result.inputs = input_fingerprints(host_path, device_path)
    timings = result.timings
    started = time.perf_counter()
    device_data = read_trace_checked(device_path, result.warnings)
    device = load_device_checked(device_path, result.warnings, device_data)
    _note_unusable_events(device, result)
    header = device_header_identity(device_data)
    del device_data
    timings["load_device_s"] = time.perf_counter() - started
    mark = time.perf_counter()
    warned = len(result.warnings)
    host_data = read_trace_checked(host_path, result.warnings)
    result.host_repair = host_repair_note(host_data)
    host = load_host_checked(host_path, result.warnings, host_data)
    del host_data
    if merged_path is not None and len(result.warnings) > warned:
        # The merged JSON is copied from the host trace file, which is not strict JSON (read here with a warning).
        result.warnings.append(f"no merged JSON for this rank: it is copied from {host_path}, which is not strict JSON "
                               "(see above); the .et is complete")
        merged_path = None
    timings["load_host_s"] = time.perf_counter() - mark
    _check_steps(host, device, result)
    _check_same_capture(host, device)
    mark = time.perf_counter()
    info = read_run_json(Path(host_path).parent)
    micro_batches = micro_batches_of(info, rank)
    linked = link_host_and_device(host, device, rank, micro_batches=micro_batches)
    _correct_for_profiler(linked, result, info, rank, micro_batches)
    timings["link_s"] = time.perf_counter() - mark
    result.identity = rank_identity(host, device, header, linked.step_start, linked.step_dur)
    if result.host_repair:
        linked.stats["host_repair"] = result.host_repair  # the .et metadata says so (convert.global_metadata)
    mark = time.perf_counter()
    out_path = Path(out_path)
    # Written under a hidden name and renamed only once validated: a failed rank never leaves a .et behind.
    try:
        with atomic_path(out_path, stage="unvalidated") as staging:
            write_et(linked, staging)
            timings["write_s"] = time.perf_counter() - mark
            if merged_path is not None:
                mark = time.perf_counter()
                try:
                    write_merged_json(linked, merged_path)
                except OSError as e:
                    raise OutputError(merged_path, f"cannot write: {_os_problem(e, Path(merged_path).parent)}") from None
                timings["merged_s"] = time.perf_counter() - mark
                result.merged_path = str(merged_path)
            result.et_path = str(out_path)
            _note_link(result, linked)
            del linked, host, device
            if validate:
                _validate_into(result, staging, timings)
            result.inputs["et"] = et_fingerprint(staging, out_path.name)
    except OSError as e:
        raise OutputError(out_path, f"cannot write the .et: {_os_problem(e, out_path.parent)}") from None
    if result.match_rate < 0.95:
        result.warnings.append(f"only {result.host_ops_matched} of {result.host_ops} host operators have a Kineto "
                               f"event ({result.match_rate:.1%}); the others are left out of the .et")
    if result.host_repair:
        result.warnings.append(f"{host_path}: {result.host_repair}; what it dropped is not in the .et")
    result.status = "ok"
    result.conversion_s = time.perf_counter() - started
    result.peak_rss_mb = peak_rss_mb()
    return result


def _correct_for_profiler(linked, result: RankResult, info, rank: int, micro_batches: MicroBatches | None) -> None:
    """Durations that estimate the untraced run (when run.json measured it), and the spread of the traced steps.
    The profiler's cost is measured against untraced steps of the traced step's micro-batches alone: a step of other
    micro-batches did other work, and calibrated to it an epoch's short last step would take a full step's time."""
    result.traced_steps_us = list(linked.stats.get("step_durations_us", []))
    result.step_spread = round(linked.stats.get("step_spread", 0.0), 4)
    result.median_scales = dict(linked.stats.get("median_scales", {}))
    count = micro_batches.of(linked.step_name) if micro_batches is not None else None
    times = step_times_of(info, rank, count)
    _note_micro_batches(linked, result, micro_batches, count, times is not None, info, rank)
    for name, lost in linked.stats.get("steps_cut", []):
        used = ", ".join(linked.device.cpu_names[k] for k in linked.traced_steps)
        result.warnings.append(f"the host trace ends inside {name}: {lost} operators the device trace has in that "
                               "step start after its last node (cut short), so that step is left out and the .et "
                               f"is made of {used}")
    if result.step_spread > STEP_SPREAD_BOUND:
        result.warnings.append(f"the {len(result.traced_steps_us)} traced steps differ by {result.step_spread:.1%} "
                               f"(more than {STEP_SPREAD_BOUND:.0%}; the .et holds their per-operator medians): "
                               + _spread_cause(times) + (_page_faults_of(times) if times is not None else ""))
    if times is None:
        result.profiler_cost_kept = _why_no_untraced_time(info, rank, count)
        return
    if GPU_OP not in linked.kind:
        _check_ranks_had_their_own_cores(times, result)
    result.untraced_step_us = times.untraced_median_us
    result.untraced_steps_us = [round(t, 1) for t in times.untraced_us]
    result.untraced_deviation = round(times.untraced_deviation, 4)
    result.untraced_left_out = times.untraced_left_out
    _check_untraced_steps_agree(times, result)
    waits = times.run_queue_median_us
    cost = remove_recording_overhead(linked, times.traced_median_us, times.untraced_median_us, times.recording_cpu_us,
                                     times.recording_cost_per_op_us, times.untraced_op_time_us,
                                     waits[0] if waits else 0.0)
    result.overhead_per_op_us = cost
    result.overhead_rule = linked.stats.get("recording_overhead_rule", "")
    if result.overhead_rule == "untraced CPU time":
        result.slowest_rank_scale = round(times.slowest_rank_scale, 4)
        _check_slowest_rank_scale(times, result)
    result.recording_overhead_us = linked.stats.get("recording_overhead_us", 0.0)
    linked.untraced_step_us = times.untraced_median_us
    removed = share_cores(linked, waits[0] if waits else None, times.communication_cpu_per_step_us,
                          times.collective_start_wait_us)
    if removed is not None:
        result.cores_shared, result.run_queue_removed_us = True, removed
        result.collective_start_wait_us = times.collective_start_wait_us or 0.0
        if times.wake_cost is not None:  # the .et carries it: simulate.py gives the simulated pauses their cost
            linked.stats["wake_cost_json"] = times.wake_cost.to_json()
            result.wake_cost = times.wake_cost.describe()
    _note_run_queue_wait(times, result, corrected=removed is not None)


def _check_untraced_steps_agree(times: StepTimes, result: RankResult) -> None:
    """Warn when a typical untraced step lies further from their median than the fidelity bound: that median is
    what the profiler's cost is measured against and what a simulation is compared with, so neither is then known
    to the bound. Two untraced steps 30% apart give a median 15% from each; one unusual step among three does
    not count (StepTimes.untraced_deviation)."""
    if times.untraced_deviation <= STEP_SPREAD_BOUND:
        return
    steps = ", ".join(f"{t / 1000:.1f}" for t in times.untraced_us)
    result.warnings.append(
        f"the {len(times.untraced_us)} untraced steps {RUN_INFO} timed ({steps} ms) lie typically "
        f"{times.untraced_deviation:.1%} from their median {times.untraced_median_us / 1000:.1f} ms (more than "
        f"{STEP_SPREAD_BOUND:.0%}): the untraced step the profiler's cost is measured against, and simulate.py "
        "compares with, is not known to that bound; time more untraced steps (--trace-wait-steps, "
        "--trace-after-steps) " + ("on a quieter machine" if times.machine_busy is not False else
                                   "or trace again"))


def _check_slowest_rank_scale(times: StepTimes, result: RankResult) -> None:
    """Warn when the slowest rank of a typical untraced step computed more than the fidelity bound beyond the
    slowest rank's median: the ranks' compute then changed that much from step to step (on a 2-core VM, one rank's
    training thread used 24 ms of CPU in most steps and 31-43 ms in 9 of 24, which gave 1.15 where 21 traces had
    given 1.00-1.06, docs/BENCHMARKS.md §4), and the .et's compute, scaled by it, holds the machine's speed in those
    steps rather than a steady one."""
    if times.slowest_rank_scale - 1 <= STEP_SPREAD_BOUND:
        return
    result.warnings.append(
        f"in the untraced steps {RUN_INFO} timed, the slowest rank of a step typically used "
        f"{times.slowest_rank_scale - 1:.1%} more training-thread CPU time than the slowest rank's median (more than "
        f"{STEP_SPREAD_BOUND:.0%}; untraced_step_thread_cpu_time_s): the ranks' compute changed that much from step "
        "to step, and the .et's compute, scaled by it, is not known to that bound; trace again"
        + (" on a quieter machine" if times.machine_busy is not False else ""))


def _why_no_untraced_time(info, rank: int, micro_batches: int | None) -> str:
    """Why the .et keeps the profiler's cost, in words, when run.json gave no pair of traced and untraced times."""
    if not isinstance(info, dict):
        return f"no {RUN_INFO} beside the traces"
    if not untraced_steps_after_the_first(info, rank):
        return f"{RUN_INFO} times no untraced step after the run's first"
    if micro_batches is not None:
        return f"no untraced step took {micro_batches} micro-batches, as the traced step did"
    return f"{RUN_INFO} times no traced step"


def _note_micro_batches(linked, result: RankResult, micro_batches: MicroBatches | None, count: int | None,
                        paired: bool, info, rank: int) -> None:
    """Say which traced steps the .et holds when they took different micro-batches (run.json), and warn when it
    holds no full step of the run or could not be measured against an untraced step of its own micro-batches."""
    if micro_batches is None or count is None:
        return
    result.micro_batches, result.full_micro_batches = count, micro_batches.full
    left_out = linked.stats.get("steps_left_out", [])
    result.steps_left_out = [name for name, _ in left_out]
    if left_out:
        used = [[linked.device.cpu_names[k], dur] for k, dur in zip(linked.traced_steps, result.traced_steps_us)]
        steps = ", ".join(f"{name}: {micro_batches.of(name) or '?'} in {dur / 1000:.1f} ms"
                          for name, dur in sorted(used + left_out, key=lambda step: (len(step[0]), step[0])))
        result.warnings.append(
            f"the traced steps took different numbers of micro-batches ({steps}; {RUN_INFO}), which is why their "
            "times differ: an epoch's last step takes the batches left over (--gradient-accumulation-steps), so it "
            f"runs other work; the .et holds the steps of {count} ({', '.join(name for name, _ in used)}) and leaves "
            f"out {', '.join(result.steps_left_out)}")
    short = count < micro_batches.full
    if not short and (paired or not untraced_steps_after_the_first(info, rank)):
        return  # a full step measured against full ones; with no untraced step at all the run's warning says it
    kept = ("so the .et keeps the profiler's cost (measured against a step of other micro-batches, it would take "
            "that step's time)")
    if short:
        result.warnings.append(
            f"the .et is an epoch's short last step: {linked.step_name} took {count} micro-batches where the run's "
            f"full step takes {micro_batches.full} ({RUN_INFO}), and the traced window holds no full step"
            + ("" if paired else f"; no untraced step took {count}, {kept}")
            + ": give a --gradient-accumulation-steps that divides an epoch's batches, or trace a window away from "
              "an epoch's end (--trace-wait-steps)")
    else:
        result.warnings.append(
            f"no untraced step after the run's first took {count} micro-batches, as the traced step "
            f"{linked.step_name} did ({RUN_INFO}), {kept}: give a --gradient-accumulation-steps that divides an "
            "epoch's batches, or time more untraced steps (--trace-wait-steps, --trace-after-steps)")


def _check_ranks_had_their_own_cores(times: StepTimes, result: RankResult) -> None:
    """Warn when a CPU run's ranks had fewer CPUs than compute threads (run.json): each rank's compute then also
    waited for the other ranks' on the same cores. The .et cannot hold that (ASTRA-sim runs every rank's compute on
    its own, and trace_tools.core_sharing reads the training thread's wait for a core as the communication threads'
    doing), so a simulation of the run comes out short by about that wait: 2-rank GPT-2 tiny runs at 2 ranks a core
    replayed at 0.47-0.84 of the real step (docs/BENCHMARKS.md §5)."""
    beyond = times.compute_threads_beyond_cpus
    if not beyond:
        return
    threads = times.intra_op_threads * times.ranks_on_machine
    result.warnings.append(
        f"the {times.ranks_on_machine} ranks on this machine ran {threads} compute threads ({times.intra_op_threads} "
        f"intra-op thread(s) each) on {times.usable_cpus} CPU(s) (run.json): each rank's compute also waited for "
        "another rank's, which the .et does not hold (ASTRA-sim gives every rank its own compute), so simulated "
        "steps come out shorter than the run's; trace with a CPU per compute thread (fewer ranks or "
        "OMP_NUM_THREADS, or more cores)")


def _spread_cause(times: StepTimes | None) -> str:
    """What the traced steps' spread says to do, from the machine's load the tracer measured in the window: other
    processes taking the CPUs is cured by a quieter machine; on a machine the run had to itself (a dedicated GPU
    server) the spread is the run's own, and the same advice would send the user after a cause that is not there."""
    share = times.other_processes_cpu_share if times is not None else None
    if share is None or times.machine_busy is None:
        return "trace again on a quieter machine for a representative .et"
    if times.machine_busy:
        return (f"other processes used {share:.0%} of the machine's CPUs in the traced window, so trace again on "
                "a quieter machine for a representative .et")
    return (f"the machine was otherwise quiet in the traced window (other processes used {share:.0%} of its CPUs), "
            "so the spread is the run's own, not the machine's")


def _page_faults_of(times: StepTimes) -> str:
    """The training thread's page faults in the traced and untraced steps, when the run counted them: a traced step
    that faults far more than an untraced one put its tensors on fresh pages (the profiler's records took the holes
    they would have reused; docs/TRAINING.md, "Host memory"), time that is the trace's, not the run's."""
    if not times.traced_page_faults or not times.untraced_page_faults:
        return ""
    traced = ", ".join(f"{n:,}" for n in times.traced_page_faults)
    untraced = statistics.median(times.untraced_page_faults)
    return (f"; the training thread page-faulted {traced} pages in the traced steps and {untraced:,.0f} in an "
            "untraced step (median): faults the untraced run does not have are the profiler's heap growth "
            "(docs/TRAINING.md, \"Host memory\")")


def _note_run_queue_wait(times: StepTimes, result: RankResult, corrected: bool) -> None:
    """How long the training thread waited for a core a step, and the CPU time gloo's threads used: the machine's
    other work (the other ranks' threads, the communication's CPU work) stretched its ops by the wait; a warning
    when the .et keeps it as compute (the run did not measure gloo's CPU time, so trace_tools.core_sharing could
    not model the sharing)."""
    waits = times.run_queue_median_us
    if waits is None:
        return
    result.run_queue_wait_us, result.untraced_run_queue_wait_us = waits
    result.communication_cpu_us = times.communication_cpu_per_step_us or 0.0
    result.interrupt_cpu_us = times.interrupt_cpu_per_step_us or 0.0
    result.communication_run_queue_wait_us = times.communication_run_queue_per_step_us or 0.0
    share = waits[1] / times.untraced_median_us if times.untraced_median_us > 0 else 0.0
    if share > STEP_SPREAD_BOUND and not corrected:
        result.warnings.append(
            f"the training thread waited for a core {share:.0%} of an untraced step ({waits[1] / 1000:.1f} of "
            f"{times.untraced_median_us / 1000:.1f} ms): other threads or processes shared its cores, and the .et "
            "holds that time as compute; a simulation of another network, where that sharing differs (the "
            "communication's own CPU work moves with its rate), is off by up to that much")


def _note_unusable_events(device, result: RankResult) -> None:
    """Events the device trace holds but the loader had to leave out: the .et lacks their time."""
    for left_out, why in ((device.unusable_events, UNUSABLE_TIME), (device.past_window_end, PAST_WINDOW_END)):
        if left_out:
            kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(left_out.items()))
            result.warnings.append(f"{device.path}: {sum(left_out.values())} event(s) left out ({kinds}): {why}")


def _check_steps(host, device, result: RankResult) -> None:
    """Warn when the host trace holds steps the device trace has not (their operators have no timing)."""
    host_steps = _step_names(host.names)
    device_steps = set(_step_names(device.cpu_names))
    extra = [name for name in host_steps if name not in device_steps]
    if device_steps and extra:
        result.warnings.append(
            f"{host.path} holds {len(host_steps)} steps ({', '.join(host_steps)}) but {device.path} only "
            f"{len(device_steps)} ({', '.join(sorted(device_steps, key=lambda n: (len(n), n)))}): the operators of "
            f"{', '.join(extra)} have no Kineto event and are left out of the .et (the profiler window and the "
            "observer did not cover the same steps)")


def _check_same_capture(host, device) -> None:
    """A host trace of another capture of the same process id links (often perfectly, for an identical program):
    refuse it by the two files' start times."""
    if host.pid is not None and device.pids and host.pid not in device.pids:
        return  # link_host_and_device names the other process
    start = None
    if device.cpu_ts:
        start = (device.base_time_ns or 0) / 1e9 + min(device.cpu_ts) / 1e6
    problem = host_device_time_problem(host.time, start)
    if problem:
        raise TraceError(host.path, f"{problem} ({device.path})")


def _os_problem(error: OSError, folder: Path) -> str:
    """An OSError of a write, in words, with the free space when the disk may be full."""
    import errno

    text = error.strerror or str(error)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = shutil.disk_usage(folder).free
            text += f" ({free / 2 ** 20:,.0f} MiB free in {folder})"
        except OSError:
            pass
        text += "; free some space (or --output-dir elsewhere), then convert_remaining.py"
    elif error.errno == errno.EFBIG:
        text += " (a limit on file sizes, `ulimit -f`, stops it); raise the limit, then convert_remaining.py"
    elif error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        text += f" ({folder} is not writable; use --output-dir)"
    return text


def describe_match(info: dict) -> str:
    """How host operators were matched to Kineto events, in words."""
    if info["mode"] == "rf_id":
        extra = f"; {info['name_mismatches']} with a different name left out" if info.get("name_mismatches") else ""
        return f"host rf_id = Kineto 'Record function id'{extra}"
    threads = ", ".join(f"host thread {t['host_tid']} -> Kineto thread {t['kineto_tid']} at offset "
                        f"{t['offset']:+d} ({t['matched']}/{t['host_ops']} ops)" for t in info.get("threads", []))
    rejected = f"; {info['nesting_rejected']} rejected for not nesting in their parent" \
        if info.get("nesting_rejected") else ""
    return f"Kineto External id = host rf_id + offset, then aligned by name in order: {threads}{rejected}"


def _note_link(result: RankResult, linked) -> None:
    """What linking found: the step, how host and device operators matched, the blocked time taken out."""
    stats = linked.stats
    result.traced_step = linked.step_name or "span of the matched operators"
    result.traced_step_us = linked.step_dur
    result.match_mode = stats["match"]["mode"]
    result.host_ops = stats["host_ops"]
    result.host_ops_matched = stats["host_ops_matched"]
    result.kineto_only_ops = stats["kineto_only_ops"]
    result.stale_host_parents = stats["stale_host_parents"]
    result.gpu_ops = stats["gpu_ops"]
    result.gpu_ops_left_out = stats["gpu_ops_outside_step"]
    result.gpu_ops_without_launch = stats["gpu_ops_without_launch"]
    if result.gpu_ops_without_launch:
        result.warnings.append(
            f"{linked.device.path}: {result.gpu_ops_without_launch} of its {stats['gpu_ops_in_device_trace']} GPU "
            "ops (kernels, copies, memsets) have no runtime call with their correlation id, so nothing says which "
            "operator launched them: they are left out of the .et")
    if stats.get("kernel_launches_without_kernel"):
        result.warnings.append(
            f"{linked.device.path}: {stats['kernel_launches_without_kernel']} of the step's "
            f"{stats['kernel_launches']} kernel launch calls have no GPU kernel in the trace (the profiler lost "
            "the GPU's records): the .et lacks that GPU work")
    result.wait_us = stats.get("wait_us", 0.0)
    result.match_detail = describe_match(stats["match"])


def _validate_into(result: RankResult, path: Path, timings: dict[str, float]) -> None:
    mark = time.perf_counter()
    report = validate_et(path)
    timings["validate_s"] = time.perf_counter() - mark
    if not report.ok:
        raise TraceError(result.et_path, "the written .et failed validation: " + "; ".join(report.problems[:3]))
    result.nodes = report.nodes
    result.nodes_by_type = report.nodes_by_type
    result.critical_path_us = report.critical_path_us
    result.traced_critical_path_us = report.traced_critical_path_us
    result.collectives = [list(c) for c in report.collectives]
    result.comm_ops = len(report.collectives) + report.p2p
    result.comm_bytes = report.comm_bytes
    by_type: dict[str, int] = {}
    for _pg, comm_type, _size in report.collectives:
        by_type[comm_type] = by_type.get(comm_type, 0) + 1
    result.comm_by_type = by_type


def peak_rss_mb() -> float:
    """Peak resident memory of this process (MiB).

    On Linux, VmHWM of /proc/self/status: ru_maxrss survives execve, so a process started by a large parent
    (pytest, a launcher) would report the parent's peak instead of its own.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def _convert_rank_task(args: tuple) -> dict:
    """Process-pool entry: never raises (but for Ctrl-C), returns the RankResult as a dict."""
    run_name, rank, host, device, out_path, merged_path = args
    started = time.perf_counter()
    try:
        result = convert_rank(host, device, out_path, rank, merged_path, run_name=run_name)
    except TraceError as e:
        result = RankResult(run=run_name, rank=rank, error=str(e))
    except MemoryError:
        result = RankResult(run=run_name, rank=rank, error=f"{host}: out of memory while converting")
    except Exception as e:  # a bug must not take the other ranks down; say what it was in one line
        logger.exception("rank %d of %s", rank, run_name)
        result = RankResult(run=run_name, rank=rank, error=f"{host}: internal error: {type(e).__name__}: {e}")
    result.conversion_s = result.conversion_s or time.perf_counter() - started
    if not result.inputs:
        result.inputs = {kind: file_fingerprint(path) for kind, path in (("host", host), ("device", device))
                         if os.path.isfile(path)}
    return asdict(result)


def _worker_setup(parent: int) -> None:
    """Ranks converted in worker processes leave Ctrl-C to the parent, which stops them and cleans up, and end with
    the parent: killed outright (kill -9, the OOM killer), it cannot stop them, and workers left running would hold
    the folder's lock (folder_held; they inherit its descriptor) against every later conversion, and rename .et files
    into a folder whose summary calls their ranks interrupted."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not die_with_parent():
        threading.Thread(target=_exit_when_orphaned, args=(parent,), name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the worker could ask to die with it
        os._exit(1)


def _exit_when_orphaned(parent: int) -> None:
    """Elsewhere: end this worker within half a second of its parent (its parent pid changes when it is orphaned)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _writable(folder: Path) -> bool:
    """Writable for us, and not marked read-only (root may write anywhere; a read-only folder is a statement)."""
    try:
        mode = folder.stat().st_mode
    except OSError:
        return False
    return os.access(folder, os.W_OK) and bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def output_dir_problem(folder: str | Path) -> str | None:
    """Why .et files cannot be written into folder (created when missing), or None."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        return "is a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "a part of the path is a file, not a folder"
    except OSError as e:
        return f"cannot be created: {e.strerror or e}"
    if not _writable(folder):
        return "is not writable (read-only folder or file system)"
    return None


def output_dir_for(run: Run, output_dir: str | Path | None, several_runs: bool) -> tuple[Path, str]:
    """Where a run's .et files go, and a note when it is not the run's own folder. Under --output-dir DIR, several
    runs go to DIR/<name> and one run to DIR itself, unless DIR/<name> holds this run's earlier conversion (made
    with other runs): convert_remaining.py of that one run then finds it, instead of converting every rank anew
    into DIR beside it."""
    if output_dir is not None:
        root = Path(output_dir)
        own = root / run.name
        if several_runs:
            return own, ""
        earlier = converted_from(own) if own.is_dir() else None
        return (own if earlier is not None and _same_folder(earlier, run.folder) else root), ""
    if _writable(run.folder):
        return run.folder, ""
    fallback = fallback_output_dir(run.name)
    return fallback, f"{run.folder} is not writable: writing to {fallback}"


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def fallback_output_dir(name: str) -> Path:
    """./converted/<name> for a run whose own folder is read-only, absolute: the summaries written there record it,
    and they are read from other working directories (simulate.py, scale_et.py)."""
    return (FALLBACK_OUTPUT_ROOT / name).absolute()


def _remove_outputs(out_dir: Path, name: str, rank: int, partial_only: bool = False) -> None:
    """A rank's .et and merged JSON (unless partial_only) and the hidden partial files a killed conversion left."""
    et, merged = glob.escape(et_name(name, rank)), glob.escape(MERGED_NAME.format(name=name, rank=rank))
    patterns = [f".{et}.unvalidated*", f"..{et}.unvalidated.*.tmp", f".{et}.*.tmp", f".{merged}.*.tmp"]
    if not partial_only:
        patterns += [et, merged]
    for pattern in patterns:
        for path in out_dir.glob(pattern):
            try:
                path.unlink()
            except OSError:
                pass


def _remove_descriptions_of_et_files(out_dir: Path) -> None:
    """The report, SIMULATION.md and simulate.py's folder of the .et files a conversion is about to replace: they
    describe those files."""
    for path in out_dir.iterdir():
        if made_from_et_files(path.name):
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            except OSError:
                pass


def output_dir_clash(runs: list[Run], output_dir: str | Path | None) -> str | None:
    """Two runs whose .et files would go to one folder, which holds one CONVERSION_SUMMARY.md: run folders of the
    same name under --output-dir, both falling back to converted/<name>, or two runs of flat files in one folder.
    The second would overwrite or mix with the first."""
    several = len(runs) > 1
    seen: dict[Path, Run] = {}
    for run in runs:
        folder = output_dir_for(run, output_dir, several)[0]
        other = seen.setdefault(folder.absolute(), run)
        if other is run:
            continue
        if other.name == run.name:
            return (f"{other.folder} and {run.folder} would both be converted into {folder} as "
                    f"{run.name}.<rank>.et; convert them one at a time with an --output-dir each")
        return (f"runs {other.name} and {run.name} would both be converted into {folder}, whose "
                f"{CONVERSION_SUMMARY} can describe one run; pass --output-dir DIR (each run goes to DIR/<name>)")
    return None


def _earlier_sets_of_these_traces(run: Run, out_dir: Path) -> list[str]:
    """Other .et sets in out_dir that its CONVERSION_SUMMARY.md records, which this conversion's summary replaces:
    those made from these very traces (the same files, by name, size and time: a run folder renamed since) are
    returned, to be removed with it; another run's set stops the conversion (OutputError), since one summary
    describes one run and the set left beside it would go undescribed (trace_report.py refuses such a folder,
    simulate.py would pick one set by name). Sets no summary records (copied in) are left alone."""
    recorded: dict[str, dict[int, RankResult]] = {}
    for rank, result in (read_previous_results(out_dir) or {}).items():
        recorded.setdefault(result.run, {})[rank] = result
    present = et_sets(out_dir)
    earlier = []
    for name, results in sorted(recorded.items()):
        if name == run.name or name not in present:
            continue
        if not all(_made_from(result, run, rank) for rank, result in results.items()):
            raise OutputError(out_dir, f"holds {name}.<rank>.et, the conversion of another run that its "
                                       f"{CONVERSION_SUMMARY} describes; converting {run.name} here would leave them "
                                       "beside it undescribed: give it another --output-dir, or remove them first")
        earlier.append(name)
    return earlier


def _made_from(result: RankResult, run: Run, rank: int) -> bool:
    """Whether the recorded result was made from this run's traces of the rank (the same files, unchanged)."""
    if rank not in run.hosts or rank not in run.devices or not result.inputs:
        return False
    now = input_fingerprints(run.hosts[rank], run.devices[rank])
    return all(result.inputs.get(kind) == now[kind] for kind in ("host", "device"))


def only_conversion_in(folder: Path):
    """Hold the folder for one conversion: a second one into it at the same time (each removing the other's
    partial files), or a report reading it, stops with an OutputError instead."""
    return folder_held(folder, lambda: OutputError(folder, "another conversion, a trace_report.py or a simulate.py "
                                                           "is using this folder now; wait for it to end"))



def convert_runs(runs: list[Run], output_dir: str | Path | None = None, jobs: int | None = None,
                 emit_merged: bool = False, progress: bool = True,
                 only: Callable[[Run, int], bool] | None = None,
                 previous: dict[str, dict[int, RankResult]] | None = None) -> list[RunResult]:
    """Convert every rank of every run (ranks in parallel processes); `only` picks the ranks to redo, the others
    keep their `previous` results. Writes CONVERSION_SUMMARY.md into each run's output folder after every rank
    (an interrupted conversion keeps what was done), then checks that each run's ranks are one run and agree on
    their collectives: a run that fails the check keeps no .et.

    Raises KeyboardInterrupt after saving the summaries of what was done, and OutputError when a summary cannot be
    written."""
    several = len(runs) > 1
    clash = output_dir_clash(runs, output_dir)
    if clash:
        raise ValueError(clash)
    with ExitStack() as held:
        for out_dir in dict.fromkeys(output_dir_for(run, output_dir, several)[0].absolute() for run in runs):
            out_dir.mkdir(parents=True, exist_ok=True)
            held.enter_context(only_conversion_in(out_dir))
        return _convert_runs(runs, output_dir, jobs, emit_merged, progress, only, previous)


def _convert_runs(runs, output_dir, jobs, emit_merged, progress, only, previous) -> list[RunResult]:
    several = len(runs) > 1
    tasks = []
    by_dir: dict[str, RunResult] = {}
    for run in runs:
        out_dir, note = output_dir_for(run, output_dir, several)
        # .et files of ranks the run does not have (an earlier conversion of a larger run of this name) would be
        # simulated as part of it
        stale_ranks = set(et_sets(out_dir).get(run.name, ())) - set(run.ranks)
        for stale in stale_ranks:
            _remove_outputs(out_dir, run.name, stale)
        earlier_sets = _earlier_sets_of_these_traces(run, out_dir)
        for earlier in earlier_sets:
            for rank in et_sets(out_dir)[earlier]:
                _remove_outputs(out_dir, earlier, rank)
        ranks: list[RankResult] = []
        kept: list[RankResult] = []  # ranks whose earlier .et stays
        for rank in run.ranks:
            if only is not None and not only(run, rank):
                earlier = (previous or {}).get(str(out_dir), {}).get(rank)
                if earlier is not None:
                    ranks.append(earlier)
                    kept.append(earlier)
                    continue
            missing = run.run_info_problem or run.missing(rank)
            if missing:
                ranks.append(RankResult(run=run.name, rank=rank, error=missing))
                _remove_outputs(out_dir, run.name, rank)
                continue
            # The earlier .et goes now, not when the new one is renamed over it: a conversion killed in between
            # must not leave it beside the new ranks' files as if it were one of them.
            _remove_outputs(out_dir, run.name, rank)
            ranks.append(RankResult(run=run.name, rank=rank, status="interrupted", error="not converted yet"))
            et_path = out_dir / et_name(run.name, rank)
            merged = out_dir / MERGED_NAME.format(name=run.name, rank=rank) if emit_merged else None
            tasks.append((str(out_dir), (run.name, rank, str(run.hosts[rank]), str(run.devices[rank]),
                                         str(et_path), str(merged) if merged else None)))
        by_dir[str(out_dir)] = RunResult(run=run, output_dir=out_dir, ranks=ranks, note=note,
                                         warnings=run_warnings(run))
        if stale_ranks or earlier_sets or len(kept) < len(ranks):  # the set of .et files changes
            _remove_descriptions_of_et_files(out_dir)
    for run_result in by_dir.values():  # the summary says from now on which ranks are still to come
        _save_summary(run_result)

    def done(key_dir: str, result: RankResult) -> None:
        run_result = by_dir[key_dir]
        run_result.ranks = [result if r.rank == result.rank else r for r in run_result.ranks]
        if not result.ok:  # no earlier .et beside a FAILED line
            _remove_outputs(run_result.output_dir, run_result.run.name, result.rank)
        _save_summary(run_result)

    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks) or 1))
    bar = _progress(len(tasks), progress)
    try:
        if jobs == 1 or len(tasks) <= 1:
            for key_dir, args in tasks:
                done(key_dir, RankResult(**_convert_rank_task(args)))
                bar.update(1)
        else:
            _convert_in_pool(tasks, jobs, done, bar)
    except KeyboardInterrupt:
        bar.close()
        for run_result in by_dir.values():
            run_result.interrupted = True
            for r in run_result.ranks:
                if r.status == "interrupted":
                    r.error = "interrupted before this rank was converted"
                    _remove_outputs(run_result.output_dir, run_result.run.name, r.rank)
            _save_summary(run_result)
        raise
    bar.close()
    for run_result in by_dir.values():
        _check_one_run(run_result)
        _save_summary(run_result)
    return list(by_dir.values())


# How a run's warnings say that no untraced step was measured for the .et durations to be corrected towards
KEEPS_PROFILER_COST = "so every .et keeps the profiler's cost (its ops take their traced time, the recording included)"


def run_warnings(run: Run) -> list[str]:
    """Warnings about the whole run, said once rather than per rank: a trace file passed over for its uncompressed
    twin (discover._prefer), and a run.json that times no untraced step after the run's first (the first holds its
    start-up, which the conversion leaves out) or no run.json at all, so that every rank's .et keeps the profiler's
    cost (on a CPU, over 2x a GPT-2 tiny step)."""
    passed_over = [f"{path}: passed over for {path.with_suffix('').name} beside it, which is converted (both "
                   "name the same trace); remove the one that is not this run's" for path in run.passed_over]
    if run.run_info_problem:
        return passed_over
    if not (run.folder / RUN_INFO).is_file():
        return passed_over + [
            f"no {RUN_INFO} beside the traces in {run.folder} (traces this project's tracer did not write, or "
            f"copied without it), {KEEPS_PROFILER_COST} and simulate.py has no measured step to compare with: copy "
            f"the run's {RUN_INFO} beside them if there is one (this project's tracer writes it beside every traced "
            "run)"]
    info = read_run_json(run.folder)
    if not isinstance(info, dict) or any(untraced_steps_after_the_first(info, rank) for rank in run.ranks):
        return passed_over
    if not info.get("ranks"):  # not a tracer's run.json ({} had been blamed on the trace window's flags)
        return passed_over + [
            f"{run.folder / RUN_INFO} records no rank's step times ({'an empty object' if not info else 'no ranks'}), "
            f"{KEEPS_PROFILER_COST}: copy the run's own {RUN_INFO}, as the tracer wrote it, beside the traces"]
    numbers = info.get("untraced_steps")
    timed = (f" (untraced_steps {numbers})" if isinstance(numbers, list) else "")
    return passed_over + [
        f"{run.folder / RUN_INFO} times no untraced step after the run's first{timed}, the first holding the run's "
        f"start-up, {KEEPS_PROFILER_COST}: trace with --trace-wait-steps 2 or more, or --trace-after-steps 1 or more"]


def _convert_in_pool(tasks: list, jobs: int, done: Callable[[str, RankResult], None], bar) -> None:
    pool = ProcessPoolExecutor(max_workers=jobs, initializer=_worker_setup, initargs=(os.getpid(),))
    try:
        futures = {pool.submit(_convert_rank_task, args): key_dir for key_dir, args in tasks}
        for future in as_completed(futures):
            done(futures[future], RankResult(**future.result()))
            bar.update(1)
    except BaseException:
        # Ctrl-C (or a summary that cannot be written): stop the workers now; a rank half converted is redone by
        # convert_remaining.py, and the caller removes what the workers leave.
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout=10)
        raise
    pool.shutdown(wait=True)


def _save_summary(run_result: RunResult) -> None:
    try:
        write_run_summary(run_result)
    except OSError as e:
        path = run_result.output_dir / CONVERSION_SUMMARY
        raise OutputError(path, f"cannot write the summary: {_os_problem(e, run_result.output_dir)}") from None


def _check_one_run(run_result: RunResult) -> None:
    """Refuse a set whose ranks are not one run or whose collectives disagree: no .et of it is kept."""
    ranks = run_result.ranks
    ok = [r for r in ranks if r.ok]
    if not ok:
        return
    problems = one_run_problems({r.rank: r.identity for r in ok if r.identity}, run_result.run.run_id,
                                [r.rank for r in ranks])
    if not problems and len(ok) == len(ranks) and len(ok) > 1:
        members = {name: group[1] for r in ok for name, group in (r.identity.get("process_groups") or {}).items()
                   if group[1]}
        problems = collectives_agree({r.rank: [tuple(c) for c in r.collectives] for r in ok}, members)
    if not problems:
        return
    run_result.agreement_problems = problems
    for r in ok:
        _remove_outputs(run_result.output_dir, run_result.run.name, r.rank)
        r.status = "refused"
        r.error = "not one run with the other ranks (see the checks); its .et was removed"


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return _NoProgress()
    from tqdm import tqdm
    return tqdm(total=total, desc="converting ranks", unit="rank", file=sys.stderr, leave=False)
