"""Training throughput: our gpt2/train.py and bert/train.py against transformers.Trainer on the same work."""
import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (BUNDLED_SQUAD, REPO_ROOT, BenchError, child_env, fail, format_table, machine_description,
                          median, our_step_times, ratio, run_child, steps_between)

CHILD_TIMEOUT_S = 3600


@dataclass(frozen=True)
class Case:
    """One comparison: the same model, batch, sequence length and precision for both trainers."""

    family: str        # gpt2 or bert
    size: str          # tiny or base (GPT-2 124M / BERT-base 110M)
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


MODEL_NAMES = {("gpt2", "tiny"): "tiny", ("gpt2", "base"): "gpt2",
               ("bert", "tiny"): "tiny", ("bert", "base"): "bert-base-uncased"}
SIZE_LABELS = {("gpt2", "tiny"): "tiny", ("gpt2", "base"): "124M", ("bert", "tiny"): "tiny", ("bert", "base"): "110M"}


def default_cases(cuda: bool, quick: bool) -> list:
    """CPU: tiny and base at a shortened sequence in fp32. GPU: base in bf16 with torch.compile (and MFU)."""
    cases = []
    for family in ("gpt2", "bert"):
        for size in ("tiny", "base"):
            name = MODEL_NAMES[(family, size)]
            if quick:
                if size == "tiny":
                    cases.append(Case(family, size, name, 4, 64, "bf16" if cuda else "fp32", False, 2, 4))
            elif cuda:
                if size == "base":
                    batch, seq = (16, 1024) if family == "gpt2" else (32, 512)
                    cases.append(Case(family, size, name, batch, seq, "bf16", True, 10, 30))
            elif size == "tiny":
                cases.append(Case(family, size, name, 8, 128, "fp32", False, 5, 20))
            else:
                cases.append(Case(family, size, name, 4, 128, "fp32", False, 2, 8))
    return cases


def our_command(case: Case, work: Path) -> list:
    command = [sys.executable, str(REPO_ROOT / case.family / "train.py"), "--model-name", case.model_name,
               "--squad-file", str(BUNDLED_SQUAD), "--batch-size", case.batch_size, "--max-seq-length", case.seq,
               "--max-steps", case.max_steps, "--precision", case.precision, "--logging-steps", "1",
               "--eval-steps", "0", "--eval-batches", "1", "--save-steps", "0", "--no-save-initial",
               "--save-dir", work / "checkpoints", "--log-dir", work / "logs", "--report-to", "none"]
    return command + (["--compile"] if case.compile else [])


def trainer_command(case: Case, work: Path) -> list:
    command = [sys.executable, str(REPO_ROOT / "bench" / "hf_trainer_run.py"), "--family", case.family,
               "--model-name", case.model_name, "--squad-file", str(BUNDLED_SQUAD), "--batch-size", case.batch_size,
               "--max-seq-length", case.seq, "--max-steps", case.max_steps, "--precision", case.precision,
               "--output-dir", work / "hf_output", "--result", work / "hf_result.json"]
    return command + (["--compile"] if case.compile else [])


@dataclass
class Measured:
    step_s: float = 0.0           # median over the measured steps
    tokens_per_s: float = 0.0
    error: str = ""


def measure_ours(case: Case, work: Path, env: dict) -> Measured:
    run = run_child(our_command(case, work), env=env, timeout_s=CHILD_TIMEOUT_S)
    if not run.ok:
        raise BenchError(f"our {case.family}/train.py ({case.model_name}) failed: {run.reason()}")
    times = our_step_times(work / "logs")
    steps = steps_between(times, case.skip_steps + 1, case.max_steps, f"our {case.family}/train.py")
    step = median(steps)
    return Measured(step, case.batch_size * case.seq / step)


def measure_trainer(case: Case, work: Path, env: dict) -> "tuple[Measured, dict]":
    run = run_child(trainer_command(case, work), env=env, timeout_s=CHILD_TIMEOUT_S)
    if not run.ok:
        raise BenchError(f"transformers.Trainer ({case.family} {case.model_name}) failed: {run.reason()}")
    result = json.loads((work / "hf_result.json").read_text(encoding="utf-8"))
    times = {i + 1: s for i, s in enumerate(result["step_s"])}
    steps = steps_between(times, case.skip_steps + 1, case.max_steps, "transformers.Trainer")
    step = median(steps)
    return Measured(step, result["tokens_per_step"] / step), result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench/train_bench.py", description=__doc__ + " Each trainer runs in its own process; tokens/s come "
        "from the median step time after the warm-up steps. Exits 1 when a side could not be measured.")
    parser.add_argument("--models", default="gpt2,bert", help="comma-separated: gpt2, bert (default: %(default)s)")
    parser.add_argument("--sizes", default="tiny,base",
                        help="comma-separated: tiny, base (GPT-2 124M / BERT-base); on a GPU only base runs "
                             "(default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="tiny models, a few steps: a smoke test of the benchmark")
    parser.add_argument("--batch-size", type=int, default=None, help="override every case's batch size")
    parser.add_argument("--max-seq-length", type=int, default=None, help="override every case's sequence length")
    parser.add_argument("--skip-steps", type=int, default=None, help="override the warm-up steps left out")
    parser.add_argument("--measure-steps", type=int, default=None, help="override the measured steps")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of each trainer (OMP_NUM_THREADS; default: torch's default, all cores)")
    parser.add_argument("--keep", metavar="DIR", default=None, help="keep each run's logs under DIR")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    cuda = torch.cuda.is_available()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [m for m in models if m not in ("gpt2", "bert")] + [s for s in sizes if s not in ("tiny", "base")]
    if unknown:
        return fail(f"unknown model or size {unknown[0]!r} (--models gpt2,bert; --sizes tiny,base)")
    for flag in ("batch_size", "max_seq_length", "measure_steps"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            return fail(f"--{flag.replace('_', '-')} must be at least 1")
    if args.skip_steps is not None and args.skip_steps < 0:
        return fail("--skip-steps must be 0 or more")
    cases = [c for c in default_cases(cuda, args.quick) if c.family in models and c.size in sizes]
    if not cases:
        return fail(f"no case for --models {args.models} --sizes {args.sizes}"
                    + (" on a GPU (only base sizes run there)" if cuda and not args.quick else ""))
    overrides = {k: getattr(args, a) for k, a in (("batch_size", "batch_size"), ("seq", "max_seq_length"),
                                                  ("skip_steps", "skip_steps"), ("measure_steps", "measure_steps"))
                 if getattr(args, a) is not None}
    cases = [replace(c, **overrides) for c in cases]
    env = child_env(threads=args.threads)

    print(machine_description())
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU'}; threads per trainer: "
          f"{args.threads or torch.get_num_threads()}")
    rows, errors = [], []
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="train_bench-"))
    try:
        for case in cases:
            label = f"{case.family} {SIZE_LABELS[(case.family, case.size)]}"
            print(f"... {label}: {case.batch_size} x {case.seq} tokens, {case.precision}"
                  f"{', compile' if case.compile else ''}, {case.skip_steps} + {case.measure_steps} steps", flush=True)
            work = root / f"{case.family}-{case.size}"
            ours = trainer = None
            info = {}
            for side in ("ours", "trainer"):
                side_dir = work / side
                shutil.rmtree(side_dir, ignore_errors=True)
                side_dir.mkdir(parents=True)
                try:
                    if side == "ours":
                        ours = measure_ours(case, side_dir, env)
                    else:
                        trainer, info = measure_trainer(case, side_dir, env)
                except BenchError as exc:
                    errors.append(str(exc))
            row = [label, f"{case.precision}{' + compile' if case.compile else ''}", f"{case.batch_size} x {case.seq}",
                   f"{case.skip_steps} + {case.measure_steps}",
                   f"{1000 * ours.step_s:.1f}" if ours else "failed",
                   f"{1000 * trainer.step_s:.1f}" if trainer else "failed",
                   f"{ours.tokens_per_s:,.0f}" if ours else "failed",
                   f"{trainer.tokens_per_s:,.0f}" if trainer else "failed",
                   ratio(ours and ours.tokens_per_s, trainer and trainer.tokens_per_s)]
            if cuda:
                fpt, peak = info.get("flops_per_token"), info.get("peak_flops")
                for side in (ours, trainer):
                    row.append(f"{100 * fpt * side.tokens_per_s / peak:.1f}%" if side and fpt and peak else "n/a")
            rows.append(row)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    headers = ["model", "precision", "batch x seq", "steps (skipped + measured)", "ours ms/step", "Trainer ms/step",
               "ours tok/s", "Trainer tok/s", "ours / Trainer"]
    if cuda:
        headers += ["ours MFU", "Trainer MFU"]
    print()
    print(format_table(headers, rows))
    print("\ntok/s = batch x seq / median step time of the measured steps; each trainer in its own process, same "
          "model config, tokenizer, data, collator, AdamW (lr 5e-5, wd 0.01, clip 1.0) and precision.")
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
