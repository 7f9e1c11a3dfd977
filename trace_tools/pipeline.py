"""Convert runs: each rank's host + device trace to a validated .et, ranks in parallel, with a summary per run."""
from __future__ import annotations

import gc
import logging
import os
import resource
import stat
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .convert import write_et, write_merged_json
from .discover import Run
from .link import COMM_TYPE_NAMES, NODE_TYPE_NAMES, link_host_and_device, remove_recording_overhead
from .step_timing import STEP_SPREAD_BOUND, read_step_times
from .load import TraceError, load_device_trace, load_host_trace
from .validate import collectives_agree, validate_et

logger = logging.getLogger(__name__)

ET_NAME = "{name}.{rank}.et"
MERGED_NAME = "{name}.{rank}.merged.json"
FALLBACK_OUTPUT_ROOT = Path("converted")


@dataclass
class RankResult:
    """What converting one rank gave: status, the .et and its numbers, or the one-line reason it failed."""

    run: str
    rank: int
    status: str = "failed"  # "ok" or "failed"
    error: str = ""
    et_path: str = ""
    merged_path: str = ""
    nodes: int = 0
    nodes_by_type: dict[str, int] = field(default_factory=dict)
    comm_ops: int = 0
    comm_bytes: int = 0
    comm_by_type: dict[str, int] = field(default_factory=dict)
    collectives: list = field(default_factory=list)
    traced_step: str = ""
    traced_step_us: float = 0.0
    critical_path_us: float = 0.0
    match_mode: str = ""
    match_detail: str = ""
    host_ops: int = 0
    host_ops_matched: int = 0
    kineto_only_ops: int = 0
    gpu_ops: int = 0
    gpu_ops_left_out: int = 0
    wait_us: float = 0.0
    untraced_step_us: float = 0.0          # measured before the profiler's window (run.json); 0 when unknown
    recording_overhead_us: float = 0.0     # profiler cost taken out of the step's CPU durations
    overhead_per_op_us: float = 0.0
    traced_steps_us: list = field(default_factory=list)  # every traced step (the .et holds the median one)
    step_spread: float = 0.0               # (longest - shortest) / median traced step
    conversion_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def match_rate(self) -> float:
        return self.host_ops_matched / self.host_ops if self.host_ops else 0.0


def load_host_checked(path: str | Path):
    """load_host_trace(), with trace_tools.repair's diagnosis as the message when the file is broken."""
    try:
        return load_host_trace(path)
    except TraceError as error:
        try:
            from .repair import diagnose_host_trace
            diagnosis = diagnose_host_trace(path)
        except Exception:  # the diagnosis is a better message, never a new failure
            raise error from None
        if diagnosis.ok:
            raise
        hint = "; run fix_host_traces.py" if diagnosis.repairable else ""
        raise TraceError(path, f"{diagnosis.problem}{hint}") from None


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
    timings = result.timings
    started = time.perf_counter()
    device = load_device_trace(device_path)
    timings["load_device_s"] = time.perf_counter() - started
    mark = time.perf_counter()
    host = load_host_checked(host_path)
    timings["load_host_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    linked = link_host_and_device(host, device, rank)
    _correct_for_profiler(linked, result, Path(host_path).parent, rank)
    timings["link_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    out_path = Path(out_path)
    # Written under a hidden name and renamed only once validated: a failed rank never leaves a .et behind.
    staging = out_path.with_name("." + out_path.name + ".unvalidated")
    try:
        write_et(linked, staging)
        timings["write_s"] = time.perf_counter() - mark
        if merged_path is not None:
            mark = time.perf_counter()
            write_merged_json(linked, merged_path)
            timings["merged_s"] = time.perf_counter() - mark
            result.merged_path = str(merged_path)
        stats = linked.stats
        result.et_path = str(out_path)
        result.traced_step = linked.step_name or "span of the matched operators"
        result.traced_step_us = linked.step_dur
        result.match_mode = stats["match"]["mode"]
        result.host_ops = stats["host_ops"]
        result.host_ops_matched = stats["host_ops_matched"]
        result.kineto_only_ops = stats["kineto_only_ops"]
        result.gpu_ops = stats["gpu_ops"]
        result.gpu_ops_left_out = stats["gpu_ops_outside_step"]
        result.wait_us = stats.get("wait_us", 0.0)
        result.match_detail = describe_match(stats["match"])
        del linked, host, device
        if validate:
            _validate_into(result, staging, timings)
        os.replace(staging, out_path)
    finally:
        staging.unlink(missing_ok=True)
    if result.match_rate < 0.95:
        result.warnings.append(f"only {result.host_ops_matched} of {result.host_ops} host operators have a Kineto "
                               f"event ({result.match_rate:.1%}); the others are left out of the .et")
    result.status = "ok"
    result.conversion_s = time.perf_counter() - started
    result.peak_rss_mb = peak_rss_mb()
    return result


def _correct_for_profiler(linked, result: RankResult, run_dir: Path, rank: int) -> None:
    """Durations that estimate the untraced run (when run.json measured it), and the spread of the traced steps."""
    result.traced_steps_us = list(linked.stats.get("step_durations_us", []))
    result.step_spread = round(linked.stats.get("step_spread", 0.0), 4)
    if result.step_spread > STEP_SPREAD_BOUND:
        result.warnings.append(f"the {len(result.traced_steps_us)} traced steps differ by {result.step_spread:.0%} "
                               f"(more than {STEP_SPREAD_BOUND:.0%}): durations are per-operator medians, but "
                               "trace again on a quieter machine for a representative .et")
    times = read_step_times(run_dir, rank)
    if times is None:
        return
    result.untraced_step_us = times.untraced_median_us
    cost = remove_recording_overhead(linked, times.traced_median_us, times.untraced_median_us)
    result.overhead_per_op_us = cost
    result.recording_overhead_us = linked.stats.get("recording_overhead_us", 0.0)
    linked.untraced_step_us = times.untraced_median_us


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


def _validate_into(result: RankResult, path: Path, timings: dict[str, float]) -> None:
    mark = time.perf_counter()
    report = validate_et(path)
    timings["validate_s"] = time.perf_counter() - mark
    if not report.ok:
        raise TraceError(result.et_path, "the written .et failed validation: " + "; ".join(report.problems[:3]))
    result.nodes = report.nodes
    result.nodes_by_type = report.nodes_by_type
    result.critical_path_us = report.critical_path_us
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
    """Process-pool entry: never raises, returns the RankResult as a dict."""
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
    return asdict(result)


@dataclass
class RunResult:
    """All ranks of one run, the cross-rank check and where the outputs went."""

    run: Run
    output_dir: Path
    ranks: list[RankResult]
    agreement_problems: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks) and not self.agreement_problems


def _writable(folder: Path) -> bool:
    """Writable for us, and not marked read-only (root may write anywhere; a read-only folder is a statement)."""
    try:
        mode = folder.stat().st_mode
    except OSError:
        return False
    return os.access(folder, os.W_OK) and bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def output_dir_for(run: Run, output_dir: str | Path | None, several_runs: bool) -> tuple[Path, str]:
    """Where a run's .et files go, and a note when it is not the run's own folder."""
    if output_dir is not None:
        root = Path(output_dir)
        return (root / run.name if several_runs else root), ""
    if _writable(run.folder):
        return run.folder, ""
    fallback = FALLBACK_OUTPUT_ROOT / run.name
    return fallback, f"{run.folder} is not writable: writing to {fallback}"


def convert_runs(runs: list[Run], output_dir: str | Path | None = None, jobs: int | None = None,
                 emit_merged: bool = False, progress: bool = True,
                 only: Callable[[Run, int], bool] | None = None,
                 previous: dict[str, dict[int, RankResult]] | None = None) -> list[RunResult]:
    """Convert every rank of every run (ranks in parallel processes); `only` picks the ranks to redo, the others
    keep their `previous` results. Writes CONVERSION_SUMMARY.md into each run's output folder."""
    from .summary import write_run_summary

    several = len(runs) > 1
    tasks = []
    placed: list[tuple[Run, Path, str]] = []
    results: dict[tuple[str, int], RankResult] = {}
    for run in runs:
        out_dir, note = output_dir_for(run, output_dir, several)
        placed.append((run, out_dir, note))
        for rank in run.ranks:
            key = (str(out_dir), rank)
            if only is not None and not only(run, rank):
                kept = (previous or {}).get(str(out_dir), {}).get(rank)
                if kept is not None:
                    results[key] = kept
                    continue
            missing = run.missing(rank)
            if missing:
                results[key] = RankResult(run=run.name, rank=rank, error=missing)
                continue
            et_path = out_dir / ET_NAME.format(name=run.name, rank=rank)
            merged = out_dir / MERGED_NAME.format(name=run.name, rank=rank) if emit_merged else None
            tasks.append((str(out_dir), (run.name, rank, str(run.hosts[rank]), str(run.devices[rank]),
                                         str(et_path), str(merged) if merged else None)))
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks) or 1))
    bar = _progress(len(tasks), progress)
    if jobs == 1 or len(tasks) <= 1:
        for key_dir, args in tasks:
            results[(key_dir, args[1])] = RankResult(**_convert_rank_task(args))
            bar.update(1)
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_convert_rank_task, args): (key_dir, args[1]) for key_dir, args in tasks}
            for future in as_completed(futures):
                results[futures[future]] = RankResult(**future.result())
                bar.update(1)
    bar.close()
    run_results = []
    for run, out_dir, note in placed:
        ranks = [results[(str(out_dir), rank)] for rank in run.ranks if (str(out_dir), rank) in results]
        ok_ranks = {r.rank: [tuple(c) for c in r.collectives] for r in ranks if r.ok}
        problems = collectives_agree(ok_ranks) if len(ok_ranks) == len(ranks) else []
        run_result = RunResult(run=run, output_dir=out_dir, ranks=ranks, agreement_problems=problems, note=note)
        write_run_summary(run_result)
        run_results.append(run_result)
    return run_results


def convert_run(run: Run, output_dir: str | Path | None = None, jobs: int | None = None,
                emit_merged: bool = False, progress: bool = False) -> RunResult:
    """Convert every rank of one run (see convert_runs)."""
    return convert_runs([run], output_dir=output_dir, jobs=jobs, emit_merged=emit_merged, progress=progress)[0]


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


def rank_result_from_dict(data: dict[str, Any]) -> RankResult:
    known = set(RankResult.__dataclass_fields__)
    return RankResult(**{k: v for k, v in data.items() if k in known})


__all__ = ["RankResult", "RunResult", "convert_rank", "convert_run", "convert_runs", "output_dir_for", "peak_rss_mb",
           "rank_result_from_dict", "COMM_TYPE_NAMES", "NODE_TYPE_NAMES"]
