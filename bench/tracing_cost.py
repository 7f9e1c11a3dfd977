"""Tracing cost: step time with tracing off, with the tracer set up outside its window, and inside it, as ratios."""
import argparse
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import (BUNDLED_SQUAD, BenchError, WorkFolder, child_env, exit_on_sigterm, fail, format_table,
                          full_vocab_tokenizer, machine_description, median, our_step_times, quick_settings, run_child,
                          steps_between, train_script)
from trace_tools.command_line import ArgumentParser
from utils.families import FAMILIES
from trace_tools.layout import RUN_INFO

CHILD_TIMEOUT_S = 3600
DEFAULT_REPEATS = 3  # alternating off/on runs; one pair is at the mercy of whatever else the machine does
TRACE_NAME = "tracing_cost"
SIZE_LABELS = {"gpt2": "124M", "bert-base-uncased": "110M", "bert-large-uncased": "340M", "gpt2-medium": "355M"}
PROFILER_WARMUP_STEPS = 1  # the tracer's default: one step recorded and thrown away before the window


@dataclass
class Plan:
    """Which optimizer steps (1-based, as the trainer logs them) fall in which condition of the traced run."""

    skip: int      # first steps of every run left out (allocator, caches)
    wait: int      # tracer set up, profiler waiting
    active: int    # inside the window
    after: int     # after the window closed

    @property
    def max_steps(self) -> int:
        return self.wait + PROFILER_WARMUP_STEPS + self.active + self.after

    @property
    def first_active(self) -> int:
        return self.wait + PROFILER_WARMUP_STEPS + 1

    @property
    def last_active(self) -> int:
        return self.first_active + self.active - 1


@dataclass
class Samples:
    """Step times pooled over repeats, per condition."""

    off: list = field(default_factory=list)
    wait: list = field(default_factory=list)
    warmup: list = field(default_factory=list)
    active: list = field(default_factory=list)
    close: list = field(default_factory=list)
    after: list = field(default_factory=list)
    tracer_active: list = field(default_factory=list)   # the tracer's own timing of the traced steps (run.json)
    trace_mb: list = field(default_factory=list)


def train_command(model: str, model_name: str, tokenizer: Path, args, plan: Plan, work: Path, tracing: bool) -> list:
    command = [sys.executable, str(train_script(model)), "--model-name", model_name,
               "--tokenizer-path", tokenizer, "--squad-file", str(BUNDLED_SQUAD), "--batch-size", args.batch_size,
               "--max-seq-length", args.max_seq_length, "--max-steps", plan.max_steps, "--logging-steps", "1",
               "--eval-steps", "0", "--eval-batches", "1", "--save-steps", "0", "--no-save-initial",
               "--save-dir", work / "checkpoints", "--log-dir", work / "logs", "--report-to", "none"]
    if tracing:
        command += ["--enable-tracing", "--trace-output-dir", work / "traces", "--trace-name", TRACE_NAME,
                    "--trace-wait-steps", plan.wait, "--trace-warmup-steps", PROFILER_WARMUP_STEPS,
                    "--trace-active-steps", plan.active]
    return command


def run_condition(model: str, model_name: str, tokenizer: Path, args, plan: Plan, work: Path, env: dict,
                  tracing: bool) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    what = f"our {model}/train.py ({model_name}, tracing {'on' if tracing else 'off'})"
    run = run_child(train_command(model, model_name, tokenizer, args, plan, work, tracing), env=env,
                    timeout_s=CHILD_TIMEOUT_S)
    # The trainer always saves its final model: 0.5 GB for GPT-2 124M per run, not needed here.
    shutil.rmtree(work / "checkpoints", ignore_errors=True)
    if not run.ok:
        raise BenchError(f"{what} failed: {run.reason()}")
    times = our_step_times(work / "logs")
    steps_between(times, 1, plan.max_steps, what)
    return times


def read_traced_run(work: Path, plan: Plan) -> "tuple[list, float]":
    """The tracer's own step times of the window (run.json) and the size of the traces it wrote."""
    folder = work / "traces" / TRACE_NAME
    info_path = folder / RUN_INFO
    if not info_path.is_file():
        raise BenchError(f"{info_path}: the tracer wrote no run.json, so the traced run cannot be trusted")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    times = info.get("step_wall_time_s_max") or []
    if len(times) != plan.active:
        raise BenchError(f"{info_path}: {len(times)} traced step times, expected {plan.active}")
    files = [folder / "host.0.json", folder / "device.0.json"]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise BenchError(f"{missing[0]}: not written; the window was not traced")
    return times, sum(p.stat().st_size for p in files) / 1e6


def measure(model: str, model_name: str, args, plan: Plan, root: Path, env: dict) -> Samples:
    samples = Samples()
    tokenizer, _, note = full_vocab_tokenizer(model, model_name, env)
    print(f"    {note}", flush=True)
    for repeat in range(args.repeats):
        # Alternate which condition runs first, so a machine getting busier or quieter favours neither.
        for tracing in ((False, True) if repeat % 2 == 0 else (True, False)):
            work = root / f"{model}-{model_name}-{'on' if tracing else 'off'}-{repeat}"
            times = run_condition(model, model_name, tokenizer, args, plan, work, env, tracing)
            if not tracing:
                samples.off += [times[s] for s in range(plan.skip + 1, plan.max_steps + 1)]
                continue
            samples.wait += [times[s] for s in range(plan.skip + 1, plan.wait + 1)]
            samples.warmup += [times[s] for s in range(plan.wait + 1, plan.first_active)]
            # The last window step also closes the window (exports both traces); it is counted on its own.
            samples.active += [times[s] for s in range(plan.first_active, plan.last_active)]
            samples.close.append(times[plan.last_active])
            samples.after += [times[s] for s in range(plan.last_active + 1, plan.max_steps + 1)]
            tracer_times, megabytes = read_traced_run(work, plan)
            samples.tracer_active += tracer_times
            samples.trace_mb.append(megabytes)
    return samples


def table_rows(label: str, samples: Samples) -> list:
    off = median(samples.off)

    def row(condition, values, note=""):
        if not values:
            return [label, condition, 0, "n/a", "n/a", note]
        step = median(values)
        return [label, condition, len(values), f"{1000 * step:.1f}", f"{step / off:.2f}x", note]

    return [
        row("tracing off", samples.off),
        row("tracer set up, before the window (wait)", samples.wait),
        row("profiler warm-up (recorded, discarded)", samples.warmup),
        row("inside the window (active)", samples.active, "last window step left out (below)"),
        row("inside the window, tracer's own timing", samples.tracer_active, "run.json step_wall_time_s"),
        row("last window step: closes the window", samples.close,
            f"exports {median(samples.trace_mb):.1f} MB host + device (rank 0)"),
        row("after the window", samples.after),
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="bench/tracing_cost.py", description=__doc__ + " Runs our trainer twice per model (tracing off, and "
        "--enable-tracing with a window in the middle of the run) with the same model, data and steps, reads each "
        "step's time from the trainer's log (--logging-steps 1) and compares medians. Exits 1 when a condition "
        "could not be measured.")
    parser.add_argument("--model", choices=list(FAMILIES), default="gpt2",
                        help="which train.py (default: %(default)s)")
    parser.add_argument("--model-names", default="tiny,gpt2",
                        help="comma-separated --model-name values, one table block each (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=2, help="(default: %(default)s)")
    parser.add_argument("--max-seq-length", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--skip-steps", type=int, default=2,
                        help="first steps of each run left out (default: %(default)s)")
    parser.add_argument("--wait-steps", type=int, default=8,
                        help="tracer steps before the window (default: %(default)s)")
    parser.add_argument("--active-steps", type=int, default=5, help="steps inside the window (default: %(default)s)")
    parser.add_argument("--after-steps", type=int, default=4, help="steps after the window (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"runs per condition, alternating (default: {DEFAULT_REPEATS}, with --quick 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of the trainer (OMP_NUM_THREADS; default: torch's default)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, few steps: a smoke test of the benchmark (overrides the step counts)")
    parser.add_argument("--keep", metavar="DIR", default=None, help="keep each run's logs and traces under DIR")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_on_sigterm()
    if args.repeats is None:
        args.repeats = 1 if args.quick else DEFAULT_REPEATS
    if args.quick:
        quick_settings(parser, argv, args, dict(model_names="tiny", batch_size=2, max_seq_length=64, skip_steps=1,
                                                wait_steps=3, active_steps=3, after_steps=2))
    names = [n.strip() for n in args.model_names.split(",") if n.strip()]
    if not names:
        return fail("--model-names is empty")
    if args.active_steps < 2:
        return fail("--active-steps must be at least 2 (the last window step also exports the traces and is "
                    "reported on its own)")
    if args.wait_steps <= args.skip_steps:
        return fail(f"--wait-steps ({args.wait_steps}) must exceed --skip-steps ({args.skip_steps}): no wait step "
                    "would be measured")
    if min(args.batch_size, args.max_seq_length, args.repeats) < 1 or min(args.skip_steps, args.after_steps) < 0:
        return fail("--batch-size, --max-seq-length and --repeats must be at least 1; step counts 0 or more")
    plan = Plan(args.skip_steps, args.wait_steps, args.active_steps, args.after_steps)
    env = child_env(threads=args.threads)
    print(machine_description(("torch", "transformers")))
    print(f"{args.model}/train.py, batch {args.batch_size} x {args.max_seq_length} tokens, {plan.max_steps} steps per "
          f"run (first {plan.skip} left out; traced run: {plan.wait} wait, {PROFILER_WARMUP_STEPS} profiler warm-up, "
          f"{plan.active} active, {plan.after} after), {args.repeats} run(s) per condition", flush=True)
    work = WorkFolder(args.keep, "tracing_cost-")
    root = work.path
    rows = []
    with work:
        try:
            for name in names:
                print(f"... {args.model} {name}", flush=True)
                samples = measure(args.model, name, args, plan, root, env)
                rows += table_rows(f"{args.model} {SIZE_LABELS.get(name, name)}", samples)
        except BenchError as exc:
            return work.fail(str(exc))
    print()
    print(format_table(["model", "condition", "steps", "median ms/step", "vs off", "note"], rows))
    print("\nStep time = the trainer's own per-step log (wall time between consecutive optimizer-step ends, "
          "including tracer.step()); median over the steps of each condition.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
