"""How fast the same memory-bound work runs in separate processes on this machine: the floor under any comparison of
one traced process with another, untraced one (what `whatif_bench.py`'s replay check does).

Each child is a fresh Python process, pinned to the same core, that times AdamW's step (torch's default CPU
implementation, one thread) on as many parameters as the GPT-2 124M shape has, with the same seed: the same work on
the same data on the same core, so what differs between the children is the process alone. On the development VM
(2026-11-27) the step took either about 195 ms or about 330 ms, the same within a process for 40 s, however often
the process allocated new tensors, with address randomisation off too: a run's memory-bound ops (the optimizer,
the gradients' copies) keep the pace their process drew at its start.

    python bench/process_pace.py [--processes 8] [--steps 8] [--parameters 86949120]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench.common import (BenchError, below_minimum, child_env, exit_on_sigterm, fail, format_table,
                          machine_description, one_core, quick_settings, run_child)
from trace_tools.command_line import ArgumentParser

GPT2_124M_SHAPE_PARAMETERS = 86_949_120
WARMUP_STEPS = 3
CHILD_TIMEOUT_S = 600


def time_adamw_steps(parameters: int, steps: int) -> list[float]:
    """Milliseconds of each AdamW step on `parameters` float32 parameters in 16 tensors, after the warm-up steps."""
    import time

    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(parameters // 16)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    times = []
    for _ in range(WARMUP_STEPS + steps):
        started = time.perf_counter()
        optimizer.step()
        times.append((time.perf_counter() - started) * 1e3)
    return times[WARMUP_STEPS:]


def measure_processes(processes: int, steps: int, parameters: int) -> list[list[float]]:
    """Each child's step times (ms), children one after another on one core."""
    core, paces = one_core(), []
    for index in range(processes):
        run = run_child([sys.executable, "-m", "bench.process_pace", "--child", "--steps", steps,
                         "--parameters", parameters], env=child_env(threads=1), cpus={core}, timeout_s=CHILD_TIMEOUT_S)
        if not run.ok:
            raise BenchError(f"process {index + 1} of {processes} failed: {run.reason()}")
        paces.append(json.loads(run.stdout.strip().splitlines()[-1]))
        # as each child ends: a machine where importing torch alone takes seconds makes the whole run minutes long
        print(f"    process {index + 1} of {processes}: median {statistics.median(paces[-1]):.1f} ms", flush=True)
    return paces


def report(paces: list[list[float]]) -> str:
    """The table of each process's steps, and the spread between processes beside the spread within them."""
    rows, medians, within = [], [], []
    for index, times in enumerate(paces, 1):
        middle = statistics.median(times)
        medians.append(middle)
        within.append((max(times) - min(times)) / middle)
        rows.append([index, len(times), f"{middle:.1f}", f"{min(times):.1f}", f"{max(times):.1f}"])
    table = format_table(["process", "steps", "median ms", "min ms", "max ms"], rows)
    fastest, slowest = min(medians), max(medians)
    return (f"{table}\n\nslowest / fastest process (medians): {slowest:.1f} / {fastest:.1f} ms = "
            f"{slowest / fastest:.2f}x; within a process the steps span at most {max(within):.1%} of its median")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=8, help="fresh processes, one after another (default 8)")
    parser.add_argument("--steps", type=int, default=8, help=f"timed steps per process, after {WARMUP_STEPS} warm-up")
    parser.add_argument("--parameters", type=int, default=GPT2_124M_SHAPE_PARAMETERS,
                        help="float32 parameters AdamW updates (default: the GPT-2 124M shape's, 86,949,120)")
    parser.add_argument("--quick", action="store_true", help="2 processes of 4 steps on 1M parameters: a smoke test")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        quick_settings(parser, argv, args, dict(processes=2, steps=4, parameters=1_048_576))
    too_small = below_minimum(args, (("processes", 1), ("steps", 1), ("parameters", 16)))  # 16: one per tensor
    if too_small:
        return fail(too_small)
    if args.child:
        print(json.dumps(time_adamw_steps(args.parameters, args.steps)))
        return 0
    exit_on_sigterm()
    print(machine_description(("torch",)))
    print(f"... {args.processes} processes on core {one_core()}, AdamW on {args.parameters:,} parameters, "
          f"{WARMUP_STEPS} + {args.steps} steps each", flush=True)
    try:
        paces = measure_processes(args.processes, args.steps, args.parameters)
    except BenchError as exc:
        return fail(str(exc))
    print(report(paces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
