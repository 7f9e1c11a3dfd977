"""The results of a conversion (per rank and per run): CONVERSION_SUMMARY.md and the table printed after it."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .atomic import write_text_atomic
from .discover import FLAT_FILE, Run
from .layout import CONVERSION_SUMMARY, PREVIOUS_RUN_DIR, RUN_INFO, STEP_PREFIX, TRACE_FILE_RE, et_name

STATUS_MARKER = "trace_tools-status"  # CONVERSION_SUMMARY.md's machine-readable block (status_comment)


@dataclass
class RankResult:
    """What converting one rank gave: status, the .et and its numbers, or the one-line reason it failed."""

    run: str
    rank: int
    status: str = "failed"  # "ok", "failed", "refused" (the set is not one run) or "interrupted"
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
    critical_path_us: float = 0.0         # of the .et as written (medians, the profiler's cost removed)
    traced_critical_path_us: float = 0.0  # of the same graph with the traced durations of the chosen step
    match_mode: str = ""
    match_detail: str = ""
    host_ops: int = 0
    host_ops_matched: int = 0
    kineto_only_ops: int = 0
    stale_host_parents: int = 0            # host parents that ended before the op began (link._link_callers)
    gpu_ops: int = 0
    gpu_ops_left_out: int = 0
    gpu_ops_without_launch: int = 0        # GPU ops whose launching runtime call is not in the device trace
    wait_us: float = 0.0
    untraced_step_us: float = 0.0          # measured before the profiler's window (run.json); 0 when unknown
    untraced_steps_us: list = field(default_factory=list)  # the untraced steps it is the median of
    untraced_deviation: float = 0.0        # their median absolute deviation / their median
    untraced_left_out: int = 0             # untraced steps left out of it: they took other micro-batches
    # median time the training thread waited for a core in a traced / an untraced step (run.json); 0 when unknown
    run_queue_wait_us: float = 0.0
    untraced_run_queue_wait_us: float = 0.0
    communication_cpu_us: float = 0.0      # mean CPU time of gloo's threads in an untraced step (run.json); 0: unknown
    # this rank's share of the machine's interrupt and softirq time in an untraced step (run.json); 0: unknown
    interrupt_cpu_us: float = 0.0
    # mean time gloo's threads waited for a core in an untraced step, summed over them (run.json); 0: unknown
    communication_run_queue_wait_us: float = 0.0
    # how long an all-reduce issued after compute waited to start (run.json), put before each collective's CPU work;
    # 0 when unknown
    collective_start_wait_us: float = 0.0
    # the machine's cost of compute after a pause (run.json; trace_tools.wake_cost), written into the .et's metadata
    # for simulate.py; "" when not measured or not used
    wake_cost: str = ""
    # trace_tools.core_sharing applied: the traced wait for a core taken out of the training thread's ops, and
    # gloo's CPU time given to the collectives as CPU nodes
    cores_shared: bool = False
    run_queue_removed_us: float = 0.0
    recording_overhead_us: float = 0.0     # profiler cost taken out of the step's CPU durations
    overhead_per_op_us: float = 0.0
    overhead_rule: str = ""                # what measured the profiler's cost: "untraced CPU time", "CPU time",
                                           # "calibrated", "critical path"
    # the training thread's ops scaled from the rank's median untraced CPU time to the slowest rank's in a step
    # (trace_tools.step_timing._slowest_rank_scale); 1.0 when not
    slowest_rank_scale: float = 1.0
    traced_steps_us: list = field(default_factory=list)  # the traced steps sampled (the .et holds the median one)
    # micro-batches of the step the .et holds and of the run's full step (run.json); 0 when run.json records none
    micro_batches: int = 0
    full_micro_batches: int = 0
    steps_left_out: list = field(default_factory=list)  # traced steps of other micro-batches, in no sample
    profiler_cost_kept: str = ""           # why the profiler's cost is not removed ("" when removed)
    step_spread: float = 0.0               # (longest - shortest) / median traced step
    median_scales: dict[str, float] = field(default_factory=dict)  # "CPU"/"GPU": typical step total / sum of medians
    conversion_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    warnings: list[str] = field(default_factory=list)
    # name, size and mtime of the host and device trace the .et was made from, and of the .et itself
    inputs: dict[str, dict] = field(default_factory=dict)
    # what the traces say about the run they come from (trace_tools.identity.rank_identity)
    identity: dict[str, Any] = field(default_factory=dict)
    # what fix_host_traces.py did to the host trace ("" when it was not repaired)
    host_repair: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def match_rate(self) -> float:
        return self.host_ops_matched / self.host_ops if self.host_ops else 0.0


@dataclass
class RunResult:
    """All ranks of one run, the cross-rank check and where the outputs went."""

    run: Run
    output_dir: Path
    ranks: list[RankResult]
    agreement_problems: list[str] = field(default_factory=list)
    note: str = ""
    warnings: list[str] = field(default_factory=list)  # about the whole run (its run.json), said once
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks) and not self.agreement_problems


def rank_result_from_dict(data: dict[str, Any]) -> RankResult:
    known = set(RankResult.__dataclass_fields__)
    return RankResult(**{k: v for k, v in data.items() if k in known})


# Results kept in the summary for convert_remaining.py (the collectives sequence is long; it is re-read from the .et)
_KEPT_FIELDS = [f for f in RankResult.__dataclass_fields__ if f != "collectives"]


def _us(value: float) -> str:
    return f"{value:,.0f}" if value else "-"


def format_bytes(value: int) -> str:
    """A byte count in B, KiB, MiB or GiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"


def node_counts(rank: RankResult) -> str:
    return ", ".join(f"{count} {name}" for name, count in sorted(rank.nodes_by_type.items())) or "-"


def comm_text(rank: RankResult) -> str:
    if not rank.comm_ops:
        return "none"
    kinds = ", ".join(f"{count} {name}" for name, count in sorted(rank.comm_by_type.items()))
    return f"{kinds or rank.comm_ops} ({format_bytes(rank.comm_bytes)})"


def replay_critical_path_us(rank: RankResult) -> float:
    """The critical path of the .et's graph with the traced durations: what replaying the trace gives back."""
    return rank.traced_critical_path_us or rank.critical_path_us


def ratio_text(rank: RankResult) -> str:
    if not rank.traced_step_us or not replay_critical_path_us(rank):
        return "-"
    return f"{replay_critical_path_us(rank) / rank.traced_step_us:.3f}"


def _untraced_samples_text(rank: RankResult) -> str:
    """How many untraced steps the untraced step is the median of, and how far they lie from it."""
    count = len(rank.untraced_steps_us)
    if count == 0:  # a summary written before the samples were recorded
        return "median of the untraced steps"
    left_out = (f" ({rank.untraced_left_out} more left out: they took other micro-batches than the traced step, as "
                "an epoch's last step does)" if rank.untraced_left_out else "")
    if count == 1:
        return f"one untraced step{left_out}"
    return f"median of {count} untraced steps{left_out}, typically {rank.untraced_deviation:.1%} from it"


def durations_text(rank: RankResult) -> str:
    """What the durations of the .et are: which step, medians over how many, and the profiler's cost removed."""
    steps = rank.traced_steps_us
    scales = ", ".join(f"{kind} x{scale:.3f}" for kind, scale in sorted(rank.median_scales.items()))
    text = (f"{len(steps)} traced steps (spread {rank.step_spread:.1%}), per-operator medians"
            + (f" scaled to a typical step's total ({scales})" if scales else "")) if len(steps) > 1 \
        else "one traced step"
    if rank.micro_batches:
        text += (f" of {rank.micro_batches} micro-batches"
                 + (" (the run's full step)" if rank.micro_batches == rank.full_micro_batches else
                    f" (an epoch's short last step; the run's full step takes {rank.full_micro_batches})")
                 + (f", {', '.join(rank.steps_left_out)} of other micro-batches left out" if rank.steps_left_out
                    else ""))
    if rank.untraced_step_us:
        measured = {"calibrated": "half the cost of recording one op, which the tracer measured on this machine",
                    "untraced CPU time": "so the training thread's ops take its CPU time in an untraced step "
                                         "(run.json; every op on that thread, one intra-op thread)",
                    "CPU time": "by the CPU time the tracer measured in traced and untraced steps, and at "
                                "least its measured cost per op",
                    "critical path": "so the critical path takes the untraced step"}.get(rank.overhead_rule, "")
        if rank.slowest_rank_scale != 1.0:  # set under the "untraced CPU time" rule only (pipeline)
            measured += (f", scaled by {rank.slowest_rank_scale:.3f}: in each step the ranks wait for that step's "
                         "slowest, whose CPU time is that much more than the slowest rank's median")
        text += (f"; profiler cost removed: {rank.recording_overhead_us / 1000:.1f} ms per step "
                 f"({rank.overhead_per_op_us:.1f} µs per op, {measured}; untraced step "
                 f"{rank.untraced_step_us / 1000:.1f} ms, {_untraced_samples_text(rank)} in run.json); critical path of the .et as written {rank.critical_path_us / 1000:.1f} ms (its "
                 "collectives at their least-waited traced duration)")
    else:
        text += f"; profiler cost not removed ({rank.profiler_cost_kept or 'no untraced step times in run.json'})"
    if rank.run_queue_wait_us or rank.untraced_run_queue_wait_us:
        text += (f"; the training thread waited for a core {rank.run_queue_wait_us / 1000:.1f} ms per traced step "
                 f"and {rank.untraced_run_queue_wait_us / 1000:.1f} ms per untraced step (run.json)")
        if rank.communication_cpu_us:
            text += (f", while gloo's threads used {rank.communication_cpu_us / 1000:.1f} ms of CPU per untraced step "
                     "on average")
            if rank.communication_run_queue_wait_us:
                text += (f" and waited {rank.communication_run_queue_wait_us / 1000:.1f} ms for a core (summed over "
                         "them, so overlapping)")
            if rank.interrupt_cpu_us:
                text += (f", and the kernel spent {rank.interrupt_cpu_us / 1000:.1f} ms per untraced step in "
                         "interrupt context (this rank's share of the machine's: mostly the packets' processing; "
                         "reported only, as the threads it interrupted may already hold it: "
                         "trace_tools.step_timing)")
        if rank.cores_shared:
            text += (f": the traced wait ({rank.run_queue_removed_us / 1000:.1f} ms) taken out of the training "
                     "thread's ops, first those that ran while a collective was in flight, and gloo's CPU time "
                     "given to the collectives as CPU nodes, by bytes (trace_tools.core_sharing)")
            if rank.collective_start_wait_us:
                text += (f", each after a wait of {rank.collective_start_wait_us / 1000:.2f} ms that holds no core (an "
                         "all-reduce issued after compute waited that long to start on average, run.json: "
                         "utils/collective_start.py)")
            if rank.wake_cost:
                text += (f"; compute after a pause took more CPU on this machine ({rank.wake_cost}; run.json, "
                         "utils/wake_cost.py): the .et's metadata records it, and simulate.py gives the training "
                         "thread's compute the cost of the simulated network's pauses instead of the traced one's "
                         "(trace_tools.wake_cost)")
        else:
            text += ", time its ops' durations hold"
    return text


def et_durations_text(ranks: list[RankResult]) -> str:
    """What the converted ranks' .et durations are, in a few words: per-operator medians or one step's, with the
    profiler's cost removed or kept (on which ranks, when they differ)."""
    medians = [r.rank for r in ranks if len(r.traced_steps_us) > 1]
    what = ("per-operator medians over the traced steps" if len(medians) == len(ranks) else
            "the traced step's durations" if not medians else
            f"per-operator medians on rank(s) {', '.join(map(str, medians))}, one traced step's durations on the others")
    kept = [r.rank for r in ranks if not r.untraced_step_us]
    unmeasured = "no untraced step of the traced step's work to measure it against"
    cost = ("removed" if not kept else f"kept: {unmeasured}" if len(kept) == len(ranks) else
            f"removed, but kept on rank(s) {', '.join(map(str, kept))}: {unmeasured}")
    return f"the .et itself holds {what} with the profiler's cost {cost}"


STATUS_MARKS = {"ok": "✅ ok", "failed": "❌ failed", "refused": "⛔ refused", "interrupted": "⏸ interrupted"}


def status_text(rank: RankResult, table: bool = False) -> str:
    """The status cell: ok / FAILED / REFUSED / INTERRUPTED in the printed table, with a mark in the summary;
    a rank made from a repaired host trace says so."""
    if table:
        text = "ok" if rank.ok else rank.status.upper()
    else:
        text = STATUS_MARKS.get(rank.status, rank.status)
    if rank.ok and rank.host_repair:
        text += " (repaired host trace)" if table else ", host trace repaired"
    return text


def rank_ranges(ranks: list[int]) -> str:
    """Ascending ranks with each run of consecutive ones as a range: "0-3, 8, 10-11"."""
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)


def rank_warnings(ranks: list[RankResult]) -> list[tuple[str, str]]:
    """The ranks' warnings, each said once with the ranks it was given for ("rank 1", "ranks 0-7", "ranks 0, 2-4,
    7"), in the order they first came: a fact about the whole run that every rank measured (the slowest rank of a
    step, a host trace cut inside the same step) had been said once per rank, 8 lines of one sentence for 8 ranks."""
    by_warning: dict[str, set[int]] = {}
    for r in ranks:
        for warning in r.warnings:
            by_warning.setdefault(warning, set()).add(r.rank)
    return [(f"rank {min(numbers)}" if len(numbers) == 1 else f"ranks {rank_ranges(sorted(numbers))}", warning)
            for warning, numbers in by_warning.items()]


def render_run_summary(result: RunResult) -> str:
    run = result.run
    ok = sum(1 for r in result.ranks if r.ok)
    state = " (interrupted: run convert_remaining.py to convert the rest)" if result.interrupted else ""
    lines = [
        f"# Conversion summary: {run.name}",
        "",
        # The trace folder absolute: simulate.py and scale_et.py read run.json there from other working directories
        f"Converted {datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')} by trace_tools from "
        f"`{run.folder.resolve()}`: {ok} of {len(result.ranks)} ranks converted{state}.",
        "",
        f"ASTRA-sim: `{shlex.quote(f'--workload-configuration={result.output_dir / run.name}')}` "
        f"(reads `{run.name}.<rank>.et`).",
        "",
        "| rank | status | nodes | communication | traced step (µs) | critical path (µs) | ratio | host ops matched | conversion (s) |",
        "|---:|---|---|---|---:|---:|---:|---|---:|",
    ]
    for r in result.ranks:
        if r.ok:
            matched = f"{r.host_ops_matched}/{r.host_ops} ({r.match_rate:.1%}, {r.match_mode})"
            lines.append(f"| {r.rank} | {status_text(r)} | {node_counts(r)} | {comm_text(r)} | "
                         f"{_us(r.traced_step_us)} | {_us(replay_critical_path_us(r))} | {ratio_text(r)} | {matched} | "
                         f"{r.conversion_s:.2f} |")
        else:
            lines.append(f"| {r.rank} | {status_text(r)} | - | - | - | - | - | - | {r.conversion_s:.2f} |")
    done = [r for r in result.ranks if r.ok and r.match_detail]
    if done:
        lines += ["", "## Details", ""]
        for r in done:
            timings = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.2f}" for k, v in r.timings.items())
            lines.append(f"- rank {r.rank}: traced step {r.traced_step}; matching: {r.match_detail}; "
                         f"{r.gpu_ops} GPU ops linked ({r.gpu_ops_left_out} of the device trace outside the step"
                         + (f", {r.gpu_ops_without_launch} without their launching runtime call"
                            if r.gpu_ops_without_launch else "") + "); "
                         f"{r.kineto_only_ops} Kineto-only CPU ops added; {r.stale_host_parents} ops whose host parent "
                         f"had ended before they began placed under the op around them in time instead; "
                         f"{r.wait_us / 1000:.1f} ms of blocked time "
                         f"taken out of op durations (it is on the path through what they waited for); "
                         f"durations: {durations_text(r)}; "
                         f"seconds: {timings}; peak memory {r.peak_rss_mb:.0f} MiB")
    failures = [r for r in result.ranks if r.status in ("failed", "interrupted")]
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- rank {r.rank}: {r.error}" for r in failures]
    lines += ["", "## Checks", ""]
    converted = [r for r in result.ranks if r.ok]
    if result.agreement_problems:
        lines.append("- ❌ the ranks are not one run, or their collectives disagree (a simulator would deadlock or "
                     "simulate a job that never ran); no .et of this run is kept:")
        lines += [f"  - {p}" for p in result.agreement_problems]
    elif failures:
        lines.append("- collectives across ranks: not compared (some ranks are not converted)")
    elif len(result.ranks) > 1:
        count = result.ranks[0].comm_ops
        lines.append(f"- ✅ the ranks come from one run (run id, world size, process groups, start times) and their "
                     f"collectives agree across the {len(result.ranks)} ranks ({count} per rank, same types and sizes "
                     "in the same order per process group)")
    lines.append("- every .et was decoded after writing: all dependencies resolve, no cycle, every node is issued by "
                 "a dependency-respecting walk, only node types ASTRA-sim accepts")
    lines.append("- ratio = critical path of the .et's graph with the traced durations of its step (collectives at "
                 "their traced durations, one after another in a process group as the .et runs them: two that "
                 "overlapped count once) / that traced step (`" + STEP_PREFIX + "N` in the device trace, or the traced "
                 "span when there is none): near 1.0, replaying the graph gives back the step it came from"
                 + (f"; {et_durations_text(converted)} (see the details)" if converted else ""))
    lines += [f"- {warning}" for warning in result.warnings]
    lines += [f"- {ranks}: {warning}" for ranks, warning in rank_warnings(result.ranks)]
    if result.note:
        lines.append(f"- {result.note}")
    status = {str(r.rank): {k: v for k, v in asdict(r).items() if k in _KEPT_FIELDS} for r in result.ranks}
    lines += status_comment(STATUS_MARKER, status)
    return "\n".join(lines)


def status_comment(marker: str, status: Any) -> list[str]:
    """The lines that end a summary with what a later run reads back (read_status_comment): `status` as JSON in an
    HTML comment, which Markdown does not show."""
    return ["", f"<!-- {marker}", json.dumps(status, sort_keys=True), "-->", ""]


def read_status_comment(path: Path, marker: str) -> Any:
    """The JSON status_comment wrote into the summary at `path` under `marker`; None when the file, the comment or
    valid JSON in it is missing."""
    try:
        match = re.search(rf"<!-- {re.escape(marker)}\n(.*?)\n-->", Path(path).read_text(encoding="utf-8"), re.S)
        return json.loads(match.group(1)) if match else None
    except (OSError, ValueError):
        return None


def write_run_summary(result: RunResult) -> Path:
    return write_text_atomic(result.output_dir / CONVERSION_SUMMARY, render_run_summary(result))


def read_previous_results(output_dir: Path) -> dict[int, RankResult] | None:
    """Per-rank results recorded in an earlier CONVERSION_SUMMARY.md (None when there is none)."""
    status = read_status_comment(output_dir / CONVERSION_SUMMARY, STATUS_MARKER)
    if status is None:
        return None
    return {int(rank): rank_result_from_dict(data) for rank, data in status.items()}


def file_fingerprint(path: str | Path) -> dict[str, Any]:
    """Name, size and modification time: what says a trace is still the one a result was made from."""
    st = os.stat(path)
    return {"name": Path(path).name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def et_fingerprint(path: str | Path, name: str | None = None) -> dict[str, Any]:
    """Name, size and SHA-256 of a written .et: it is still the file a summary describes (whatever its mtime)."""
    data = Path(path).read_bytes()
    return {"name": name or Path(path).name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def script_command(module: str) -> str:
    """A top-level script (convert_remaining, scale_et) as a shell command that runs it from anywhere: this Python
    (it has the conversion packages) on the checkout's script, as setup_and_convert.sh prints its retry, or
    `-m <module>` where the package was installed without a checkout. A bare `convert_remaining.py ...`, pasted as
    the docs say, was `command not found`."""
    script = Path(__file__).resolve().parent.parent / f"{module}.py"
    python = shlex.quote(sys.executable)
    return f"{python} {shlex.quote(str(script))}" if script.is_file() else f"{python} -m {module}"


def convert_remaining_command() -> str:
    return script_command("convert_remaining")


def reconvert_command(folder: Path) -> str:
    """The command that converts again the run whose .et files are in folder (its traces may be elsewhere)."""
    source = converted_from(folder)
    holds_traces = any(TRACE_FILE_RE.match(path.name) or FLAT_FILE.match(path.name) for path in folder.iterdir())
    if source is None or holds_traces or not source.is_dir():
        return f"{convert_remaining_command()} {shlex.quote(str(folder))}"
    return f"{convert_remaining_command()} {shlex.quote(str(source))} --output-dir {shlex.quote(str(folder))}"


def recorded_ranks(folder: Path, name: str) -> dict[int, RankResult]:
    """What the folder's CONVERSION_SUMMARY.md records of each rank of the set `name` (empty when it records none)."""
    return {rank: result for rank, result in (read_previous_results(folder) or {}).items() if result.run == name}


def records_set(folder: Path, name: str) -> bool:
    """Whether the folder's CONVERSION_SUMMARY.md records a conversion of the set `name`."""
    return bool(recorded_ranks(folder, name))


def unrecorded_et_file(folder: Path, name: str, ranks: Iterable[int], *,
                       every_recorded_rank: bool = True) -> tuple[Path, str] | None:
    """The first .et of the set `name` in folder, among those of `ranks`, that is not the file the folder's
    CONVERSION_SUMMARY.md recorded as converted, and why: one left from a conversion of another run, one copied in
    from another run, or one changed or cut short since (an .et cut at a node boundary still decodes, and would be
    read as it is); or a rank it records converted that `ranks` lacks (deleted since, or a folder in its place).
    every_recorded_rank: a rank it records as failed that `ranks` lacks is a problem too (without it, such a rank is
    the caller's missing rank). None when every file is as recorded, or when no summary records this set (.et files
    from elsewhere, a scaled set)."""
    recorded = recorded_ranks(folder, name)
    if not recorded:
        return None
    present = set(ranks)
    converted = {rank for rank, result in recorded.items() if result.ok}
    summary, again = folder / CONVERSION_SUMMARY, reconvert_command(folder)
    for rank in sorted(present | (set(recorded) if every_recorded_rank else converted)):
        et, result = folder / et_name(name, rank), recorded.get(rank)
        if result is None:
            return et, (f"{summary} records no rank {rank} of {name}: the file is left from another conversion "
                        f"({again} converts the run again)")
        if not result.ok:
            return et, (f"{summary} says rank {rank} was not converted ({result.status}: {result.error}); "
                        f"{again} converts it")
        if rank not in present and et.is_dir():
            return et, (f"a folder, though {summary} records the rank's .et converted (move it away; {again} makes "
                        "the .et again)")
        if rank not in present:
            return et, f"missing, though {summary} records it converted ({again} makes it again)"
        expected = (result.inputs or {}).get("et")
        if expected and et_fingerprint(et, expected.get("name")) != expected:
            return et, (f"not the file {summary} recorded (another run's .et, or changed or cut short since it was "
                        f"written); {again} makes it again")
    return None


def converted_from(output_dir: Path) -> Path | None:
    """The trace folder the conversion into output_dir read, as its CONVERSION_SUMMARY.md names it (None if unknown).
    Summaries record it absolute; older ones as it was typed, relative to a working directory no longer known: that
    path from here when it is a folder, else from output_dir."""
    try:
        match = re.search(r"by trace_tools from `([^`]+)`", (output_dir / CONVERSION_SUMMARY).read_text(encoding="utf-8"))
    except OSError:
        return None
    if not match:
        return None
    recorded = Path(match[1])
    return next((path for path in (recorded, output_dir / recorded) if path.is_dir()), recorded)


def render_table(results: list[RunResult]) -> str:
    """The table printed after converting: one line per rank, then every error and warning in one line each."""
    rows = [("run", "rank", "status", "nodes", "communication", "step µs", "crit. path µs", "ratio", "matched", "s")]
    for result in results:
        for r in result.ranks:
            if r.ok:
                rows.append((result.run.name, str(r.rank), status_text(r, table=True), str(r.nodes), comm_text(r),
                             _us(r.traced_step_us), _us(replay_critical_path_us(r)), ratio_text(r), f"{r.match_rate:.1%}",
                             f"{r.conversion_s:.2f}"))
            else:
                rows.append((result.run.name, str(r.rank), status_text(r, table=True), "-", "-", "-", "-", "-", "-",
                             f"{r.conversion_s:.2f}"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    out = ["  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip() for row in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    untraced = [f"{result.run.name} rank {r.rank} {r.untraced_step_us:,.0f}" for result in results
                for r in result.ranks if r.ok and r.untraced_step_us]  # a refused rank has no .et to estimate
    if untraced:
        out.append("the .et durations estimate the untraced step (µs, run.json): " + "; ".join(untraced))
    for result in results:
        # once each: a run-wide problem (run.json unreadable) fails every rank with the same line
        for error in dict.fromkeys(r.error for r in result.ranks if r.status == "failed"):
            out.append(f"error: {error}")
        for problem in result.agreement_problems:
            out.append(f"error: {result.run.folder}: {problem}; no .et kept")
        for warning in result.warnings:
            out.append(f"warning: {result.run.name}: {warning}")
        for ranks, warning in rank_warnings(result.ranks):
            out.append(f"warning: {result.run.name} {ranks}: {warning}")
    return "\n".join(out)


@dataclass
class ConvertedRun:
    """What a folder's CONVERSION_SUMMARY.md recorded of the run its .et files were made from: the run id the traces
    carry (identity.run_id) and the run.json the conversion read (inputs.run_info: name, size, mtime), the records
    convert_remaining.py tells changed traces and run.json by. Both empty for an older summary, or none."""

    folder: Path
    traces: Path | None = None  # the trace folder the conversion read run.json in
    run_ids: set[str] = field(default_factory=set)
    run_info: list[dict] = field(default_factory=list)

    @classmethod
    def recorded_in(cls, folder: Path) -> ConvertedRun:
        run = cls(Path(folder), converted_from(Path(folder)))
        for result in (read_previous_results(folder) or {}).values():
            if (result.identity or {}).get("run_id"):
                run.run_ids.add(str(result.identity["run_id"]))
            recorded = (result.inputs or {}).get("run_info")
            if recorded and recorded not in run.run_info:
                run.run_info.append(recorded)
        return run

    @property
    def recorded(self) -> bool:
        return bool(self.run_ids or self.run_info)

    def holds(self, path: Path, info) -> bool | None:
        """Whether the run.json at `path` (its content `info`, None when unreadable) is this run's: the file the
        conversion read, or one with the traces' run id (True); another run's, or without run ids a file in the
        trace folder other than the one read there (False); None when nothing recorded tells (a copy without a run
        id beside the .et files is taken as it is)."""
        if not self.recorded:
            return None
        try:
            if file_fingerprint(path) in self.run_info:
                return True
        except OSError:
            return None
        found = info.get("run_id") if isinstance(info, dict) else None
        if found and self.run_ids:
            return str(found) in self.run_ids
        in_traces = self.traces is not None and self.traces.is_dir() and path.parent.resolve() == self.traces.resolve()
        return False if self.run_info and in_traces else None

    def other_run(self, path: Path, info) -> str | None:
        """Why the run.json at `path` is not this run's (holds() is False), or None."""
        if self.holds(path, info) is not False:
            return None
        found = info.get("run_id") if isinstance(info, dict) else None
        if found and self.run_ids:
            return (f"another run's (run_id {found}; the .et files in {self.folder} were made from run "
                    f"{', '.join(sorted(self.run_ids))})")
        return (f"not the run.json the .et files in {self.folder} were converted with (its size or time differ from "
                f"those {CONVERSION_SUMMARY} recorded, and it has no run id to tell)")


def run_info_files(folder: Path) -> tuple[list[Path], Path | None]:
    """The run.json files that may be the one of the .et files in folder, and where the run's earlier files would
    be: beside the .et files, in the trace folder CONVERSION_SUMMARY.md names, and in that folder's
    .previous/<name>/, where the tracer moves a run traced again under the same name (the last is the run's only
    when ConvertedRun.holds says so)."""
    traces = converted_from(Path(folder))
    candidates = [folder / RUN_INFO]
    previous = None
    if traces is not None:
        previous = traces.parent / PREVIOUS_RUN_DIR / traces.name / RUN_INFO
        candidates += [traces / RUN_INFO, previous]
    seen, found = set(), []
    for path in candidates:
        if path.is_file() and path.resolve() not in seen:
            seen.add(path.resolve())
            found.append(path)
    return found, previous
