"""What a pause costs the step after it: the same training step, back to back and after the thread waited.

A step traced on a fast network runs right after the last one; on a slow network the training thread waits seconds
for the gradients' all-reduce, and its next ops start after that pause. If the machine runs the same work slower
after a pause (what else ran meanwhile may have taken its caches), a `.et` from a fast network predicts the slow
one's compute too short by that much, and no rule in the converter can see it: the trace holds no pause. This
measures it on the machine (docs/BENCHMARKS.md §4b: 0-5% for the 124M shape on the development VM, 1.05-1.21x
for GPT-2 tiny after 0.15 s, both inside the rounds' own drift).

One child, pinned to one core with one thread, builds a model of the what-if benchmark with the trainer's offline
stand-in vocabulary (--model: the GPT-2 124M shape, 12 x 768, 86,949,120 parameters, on a 1 x 128 batch; or GPT-2
tiny, 225,088 parameters, on a 4 x 128 batch, whose weights and optimizer state fit in a cache where the 124M
shape's never do) and times forward, backward and AdamW's step, in rounds of three kinds: back to back, each step
after sleeping --pause-s seconds, and each after spinning that long (the core kept busy on a loop that touches no
memory, so a core that slows down when it idles would not show). The thread's CPU time per step is the measure: a
pause costs nothing in CPU time unless the work after it does more.

    python bench/pause_cost.py [--model gpt2-124m-shape|tiny] [--pause-s 4] [--rounds 3] [--steps 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench.common import (BenchError, below_minimum, child_env, exit_on_sigterm, fail, format_table,
                          machine_description, one_core, quick_settings, run_child)
from trace_tools.command_line import ArgumentParser

KINDS = ("back to back", "after a sleep", "after a spin")
OFFLINE_VOCABULARY = 1441  # the trainer's offline stand-in vocabulary (the 124M shape: 86,949,120 parameters in all)
# --model: (label, GPT2_SIZES key, batch size), as bench/whatif_bench.py runs them
MODELS = {"gpt2-124m-shape": ("GPT-2 124M shape", "gpt2", 1), "tiny": ("GPT-2 tiny", "tiny", 4)}
SEQUENCE_LENGTH = 128
WARMUP_STEPS = 3
CHILD_TIMEOUT_S = 3600


def time_steps(rounds: int, steps: int, pause_s: float, model_key: str, quick: bool) -> dict:
    """In this process: {"parameters": n, "batch": [rows, tokens], "rounds": [{kind: [thread CPU ms of each step]}]},
    kinds interleaved in every round so that a drift of the machine weighs on each alike."""
    import time

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2.config import GPT2_SIZES

    torch.set_num_threads(1)
    torch.manual_seed(0)
    _, size, batch_size = MODELS[model_key]
    config = GPT2Config(**{**GPT2_SIZES[size], "vocab_size": 512 if quick else OFFLINE_VOCABULARY,
                           "bos_token_id": 0, "eos_token_id": 0})
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, config.vocab_size, (1 if quick else batch_size, SEQUENCE_LENGTH))

    def step() -> float:
        started = time.thread_time()
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return (time.thread_time() - started) * 1e3

    def pause(kind: str) -> None:
        if kind == "after a sleep":
            time.sleep(pause_s)
        elif kind == "after a spin":
            end = time.perf_counter() + pause_s
            while time.perf_counter() < end:
                pass

    for _ in range(WARMUP_STEPS):
        step()
    measured = []
    for _ in range(rounds):
        times = {kind: [] for kind in KINDS}
        for kind in KINDS:
            for _ in range(steps):
                pause(kind)
                times[kind].append(step())
        measured.append(times)
    return {"parameters": sum(p.numel() for p in model.parameters()), "batch": list(batch.shape), "rounds": measured}


def report(measured: dict, pause_s: float) -> str:
    """A row per round and kind, then each pause kind's median over the back-to-back median of its round."""
    rows, ratios = [], {kind: [] for kind in KINDS[1:]}
    for number, times in enumerate(measured["rounds"], 1):
        base = statistics.median(times[KINDS[0]])
        for kind in KINDS:
            middle = statistics.median(times[kind])
            rows.append([number, kind, len(times[kind]), f"{middle:.1f}", f"{min(times[kind]):.1f}",
                         f"{max(times[kind]):.1f}", f"{middle / base:.3f}x"])
            if kind in ratios:
                ratios[kind].append(middle / base)
    table = format_table(["round", "kind", "steps", "median CPU ms", "min ms", "max ms", "over back to back"], rows)
    lines = [f"{kind} of {pause_s:g} s: the step's CPU time is {statistics.median(values):.3f}x the back-to-back "
             f"step's (median over {len(values)} rounds; {min(values):.3f}x-{max(values):.3f}x)"
             for kind, values in ratios.items()]
    return table + "\n\n" + "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2-124m-shape",
                        help="the model whose step is timed (default: %(default)s)")
    parser.add_argument("--pause-s", type=float, default=4.0, help="seconds of each pause (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three kinds (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps of each kind in a round (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="GPT-2 tiny on a 1 x 128 batch, 1 round of 2 steps, 0.2 s pauses: a smoke test")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        quick_settings(parser, argv, args, dict(rounds=1, steps=2, pause_s=0.2, model="tiny"))
    too_small = below_minimum(args, (("rounds", 1), ("steps", 1)))
    if too_small:
        return fail(too_small)
    if not 0 < args.pause_s <= 600:
        return fail(f"--pause-s {args.pause_s:g}: must be more than 0 and at most 600 seconds")
    if args.child:
        print(json.dumps(time_steps(args.rounds, args.steps, args.pause_s, args.model, args.quick)))
        return 0
    exit_on_sigterm()
    print(machine_description(("torch", "transformers")))
    core = one_core()
    print(f"... one process on core {core}: {args.rounds} round(s) of {args.steps} steps of each kind, pauses of "
          f"{args.pause_s:g} s", flush=True)
    argv = [sys.executable, "-m", "bench.pause_cost", "--child", "--rounds", args.rounds, "--steps", args.steps,
            "--pause-s", args.pause_s, "--model", args.model] + (["--quick"] if args.quick else [])
    run = run_child(argv, env=child_env(threads=1), cpus={core}, timeout_s=CHILD_TIMEOUT_S)
    try:
        if not run.ok:
            raise BenchError(f"the timing process failed: {run.reason()}")
        measured = json.loads(run.stdout.strip().splitlines()[-1])
    except BenchError as exc:
        return fail(str(exc))
    rows, tokens = measured["batch"]
    print(f"model: {MODELS[args.model][0]}, {measured['parameters']:,} parameters, batch {rows} x {tokens}, fp32, one "
          "thread")
    print(report(measured, args.pause_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
