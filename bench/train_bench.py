"""Training throughput: our gpt2/train.py and bert/train.py against transformers.Trainer on the same work."""
import argparse
import json
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from bench.common import (BUNDLED_SQUAD, REPO_ROOT, BenchError, WorkFolder, child_env, exit_on_sigterm, fail,
                          format_table, full_vocab_tokenizer, machine_description, median, our_step_times, ratio,
                          run_child, steps_between, train_script)
from trace_tools.command_line import ArgumentParser
from utils.families import FAMILIES, family_info

CHILD_TIMEOUT_S = 3600
DEFAULT_REPEATS = 2
SIZES = ("tiny", "base")  # base: each family's default model (GPT-2 124M, BERT-base 110M)
GPU_TOKENS_PER_STEP = 16384  # the base cases on a GPU: batch x its context length (GPT-2 16 x 1024, BERT 32 x 512)


@dataclass(frozen=True)
class Case:
    """One comparison: the same model, batch, sequence length and precision for both trainers."""

    family: str        # a registered family (utils/families.py)
    size: str          # tiny or base (the family's default model)
    model_name: str    # --model-name of our train.py
    batch_size: int
    seq: int
    precision: str
    compile: bool
    skip_steps: int    # warm-up steps left out of the measurement (allocator, caches, compilation)
    measure_steps: int

    @property
    def max_steps(self) -> int:
        return self.skip_steps + self.measure_steps


def size_label(case: Case) -> str:
    return case.size if case.size == "tiny" else family_info(case.family).default_size or case.model_name


def default_cases(cuda: bool, quick: bool) -> list:
    """CPU: tiny and base at a shortened sequence in fp32. GPU: base in bf16 with torch.compile (and MFU)."""
    cases = []
    for family, info in FAMILIES.items():
        for size in SIZES:
            name = "tiny" if size == "tiny" else info.default_model
            if quick:
                if size == "tiny":
                    cases.append(Case(family, size, name, 4, 64, "bf16" if cuda else "fp32", False, 2, 4))
            elif cuda:
                if size == "base":
                    seq = info.context_length
                    cases.append(Case(family, size, name, GPU_TOKENS_PER_STEP // seq, seq, "bf16", True, 10, 30))
            elif size == "tiny":
                cases.append(Case(family, size, name, 8, 128, "fp32", False, 5, 20))
            else:
                cases.append(Case(family, size, name, 4, 128, "fp32", False, 2, 8))
    return cases


def our_command(case: Case, work: Path, tokenizer: Path) -> list:
    command = [sys.executable, str(train_script(case.family)), "--model-name", case.model_name,
               "--tokenizer-path", tokenizer, "--squad-file", str(BUNDLED_SQUAD), "--batch-size", case.batch_size,
               "--max-seq-length", case.seq, "--max-steps", case.max_steps, "--precision", case.precision,
               "--logging-steps", "1",
               "--eval-steps", "0", "--eval-batches", "1", "--save-steps", "0", "--no-save-initial",
               "--save-dir", work / "checkpoints", "--log-dir", work / "logs", "--report-to", "none"]
    return command + (["--compile"] if case.compile else [])


def trainer_command(case: Case, work: Path, tokenizer: Path) -> list:
    command = [sys.executable, str(REPO_ROOT / "bench" / "hf_trainer_run.py"), "--family", case.family,
               "--tokenizer-path", tokenizer, "--model-name", case.model_name, "--squad-file", str(BUNDLED_SQUAD),
               "--batch-size", case.batch_size,
               "--max-seq-length", case.seq, "--max-steps", case.max_steps, "--precision", case.precision,
               "--output-dir", work / "hf_output", "--result", work / "hf_result.json", "--report-to", "none"]
    return command + (["--compile"] if case.compile else [])


def measure_ours(case: Case, work: Path, env: dict, tokenizer: Path) -> list:
    """Our trainer's measured step times (seconds), from its per-step log."""
    run = run_child(our_command(case, work, tokenizer), env=env, timeout_s=CHILD_TIMEOUT_S)
    # The trainer always saves its final model: 0.5 GB for GPT-2 124M per run, not needed here.
    shutil.rmtree(work / "checkpoints", ignore_errors=True)
    if not run.ok:
        raise BenchError(f"our {case.family}/train.py ({case.model_name}) failed: {run.reason()}")
    times = our_step_times(work / "logs")
    return steps_between(times, case.skip_steps + 1, case.max_steps, f"our {case.family}/train.py")


def measure_trainer(case: Case, work: Path, env: dict, tokenizer: Path) -> "tuple[list, dict]":
    """transformers.Trainer's measured step times (seconds), from its callback, and what the child reported."""
    run = run_child(trainer_command(case, work, tokenizer), env=env, timeout_s=CHILD_TIMEOUT_S)
    if not run.ok:
        raise BenchError(f"transformers.Trainer ({case.family} {case.model_name}) failed: {run.reason()}")
    result = json.loads((work / "hf_result.json").read_text(encoding="utf-8"))
    times = {i + 1: s for i, s in enumerate(result["step_s"])}
    return steps_between(times, case.skip_steps + 1, case.max_steps, "transformers.Trainer"), result


def measure_case(case: Case, work: Path, env: dict, repeats: int, tokenizer: Path) -> "tuple[dict, dict, list]":
    """Step times of both sides pooled over repeats (alternating which runs first), the Trainer child's report,
    and (side, message) for each side that failed."""
    pooled, info, errors = {"ours": [], "trainer": []}, {}, []
    for repeat in range(repeats):
        for side in (("ours", "trainer") if repeat % 2 == 0 else ("trainer", "ours")):
            if side in {e[0] for e in errors}:
                continue
            side_dir = work / f"{side}-{repeat}"
            shutil.rmtree(side_dir, ignore_errors=True)
            side_dir.mkdir(parents=True)
            try:
                if side == "ours":
                    pooled[side] += measure_ours(case, side_dir, env, tokenizer)
                else:
                    steps, info = measure_trainer(case, side_dir, env, tokenizer)
                    pooled[side] += steps
            except BenchError as exc:
                errors.append((side, str(exc)))
    return pooled, info, errors


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="bench/train_bench.py", description=__doc__ + " Each trainer runs in its own process; tokens/s come "
        "from the median step time after the warm-up steps. Exits 1 when a side could not be measured.")
    parser.add_argument("--models", default=",".join(FAMILIES),
                        help=f"comma-separated: {', '.join(FAMILIES)} (default: %(default)s)")
    parser.add_argument("--sizes", default=",".join(SIZES),
                        help="comma-separated: tiny, base (each model's default size: GPT-2 124M / BERT-base); on a "
                             "GPU only base runs (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="tiny models, a few steps: a smoke test of the benchmark")
    parser.add_argument("--batch-size", type=int, default=None, help="override every case's batch size")
    parser.add_argument("--max-seq-length", type=int, default=None, help="override every case's sequence length")
    parser.add_argument("--skip-steps", type=int, default=None, help="override the warm-up steps left out")
    parser.add_argument("--measure-steps", type=int, default=None, help="override the measured steps")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs per side, alternating which goes first; step times are pooled "
                             f"(default: {DEFAULT_REPEATS}, with --quick 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of each trainer (OMP_NUM_THREADS; default: torch's default, all cores)")
    parser.add_argument("--keep", metavar="DIR", default=None, help="keep each run's logs under DIR")
    return parser


def plan_cases(args: argparse.Namespace, cuda: bool) -> list:
    """The cases the flags ask for (BenchError for an unknown model or size, a bad override, or none left)."""
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [m for m in models if m not in FAMILIES] + [s for s in sizes if s not in SIZES]
    if unknown:
        raise BenchError(f"unknown model or size {unknown[0]!r} (--models {','.join(FAMILIES)}; --sizes "
                         f"{','.join(SIZES)})")
    for flag in ("batch_size", "max_seq_length", "measure_steps", "repeats"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise BenchError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.skip_steps is not None and args.skip_steps < 0:
        raise BenchError("--skip-steps must be 0 or more")
    cases = [c for c in default_cases(cuda, args.quick) if c.family in models and c.size in sizes]
    if not cases:
        raise BenchError(f"no case for --models {args.models} --sizes {args.sizes}"
                         + (" on a GPU (only base sizes run there)" if cuda and not args.quick else ""))
    overrides = {k: getattr(args, a) for k, a in (("batch_size", "batch_size"), ("seq", "max_seq_length"),
                                                  ("skip_steps", "skip_steps"), ("measure_steps", "measure_steps"))
                 if getattr(args, a) is not None}
    return [replace(c, **overrides) for c in cases]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    exit_on_sigterm()
    repeats = args.repeats if args.repeats is not None else 1 if args.quick else DEFAULT_REPEATS
    import torch
    cuda = torch.cuda.is_available()
    try:
        cases = plan_cases(args, cuda)
    except BenchError as exc:
        return fail(str(exc))
    try:
        import accelerate  # noqa: F401  (transformers.Trainer cannot run without it)
    except ImportError as exc:
        return fail(f"transformers.Trainer needs the accelerate package, so the reference cannot be measured "
                    f"({exc}); pip install accelerate")
    env = child_env(threads=args.threads)

    print(machine_description())
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU'}; threads per trainer: "
          f"{args.threads or torch.get_num_threads()}")
    rows, errors = [], []
    work = WorkFolder(args.keep, "train_bench-")
    root = work.path
    with work:
        for case in cases:
            label = f"{case.family} {size_label(case)}"
            print(f"... {label}: {case.batch_size} x {case.seq} tokens, {case.precision}"
                  f"{', compile' if case.compile else ''}, {case.skip_steps} + {case.measure_steps} steps", flush=True)
            try:
                tokenizer, _, note = full_vocab_tokenizer(case.family, case.model_name, env)
            except BenchError as exc:
                errors.append(str(exc))
                continue
            print(f"    {note}", flush=True)
            pooled, info, case_errors = measure_case(case, root / f"{case.family}-{case.size}", env, repeats,
                                                     tokenizer)
            errors += [message for _, message in case_errors]
            failed = {side for side, _ in case_errors}
            step = {side: median(times) if times and side not in failed else None for side, times in pooled.items()}
            # The Trainer child reports the sequence length both used (capped at the model's positions like ours).
            tokens = info.get("tokens_per_step", case.batch_size * case.seq)
            rate = {side: tokens / s if s else None for side, s in step.items()}
            row = [label, f"{case.precision}{' + compile' if case.compile else ''}", f"{case.batch_size} x {case.seq}",
                   f"{case.skip_steps} + {case.measure_steps}" + (f" (x{repeats})" if repeats > 1 else "")]
            row += [f"{1000 * step[side]:.1f}" if step[side] else "failed" for side in ("ours", "trainer")]
            row += [f"{rate[side]:,.0f}" if rate[side] else "failed" for side in ("ours", "trainer")]
            row.append(ratio(rate["ours"], rate["trainer"]))
            if cuda:
                fpt, peak = info.get("flops_per_token"), info.get("peak_flops")
                for side in ("ours", "trainer"):
                    row.append(f"{100 * fpt * rate[side] / peak:.1f}%" if rate[side] and fpt and peak else "n/a")
            rows.append(row)
        work.failed = bool(errors)  # the logs the errors name stay
    headers = ["model", "precision", "batch x seq", "steps (skipped + measured)", "ours ms/step", "Trainer ms/step",
               "ours tok/s", "Trainer tok/s", "ours / Trainer"]
    if cuda:
        headers += ["ours MFU", "Trainer MFU"]
    print()
    print(format_table(headers, rows))
    print("\ntok/s = batch x seq / median step time of the measured steps; each trainer in its own process, same "
          "model config, tokenizer, batches in the same order, collator, AdamW (lr 5e-5, wd 0.01, clip 1.0) and "
          "precision.")
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if errors and not work.kept:
        print(f"note: the runs' files are kept in {root}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
