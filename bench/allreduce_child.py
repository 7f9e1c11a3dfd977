"""One rank of the all-reduce micro-benchmark (started by torchrun): gloo all-reduce times of a few message sizes.

By default the ranks meet at a barrier before each timed all-reduce, so each starts on idle cores with gloo's threads
just woken. With --after-compute-ms LOW,HIGH, each rank computes instead, as a training step does before its
gradients' all-reduce, for a time drawn anew each repeat between LOW and HIGH ms (the same draw on every rank): a
fixed time would start every all-reduce at the same phase of the kernel's timer tick, and on a kernel that lets a
woken thread wait for the next tick the result would depend on that phase. The time counts from the later rank's
call.
"""
import argparse
import json
import random
import time

import torch
import torch.distributed as dist


def compute_for(seconds: float, matrix: torch.Tensor) -> torch.Tensor:
    """Matrix products on this rank's core until `seconds` have passed."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        matrix = torch.tanh(matrix @ matrix)
    return matrix


def compute_range_ms(text: str) -> tuple:
    """--after-compute-ms's value: LOW,HIGH (or one number for both) in ms."""
    low, _, high = text.partition(",")
    low_ms, high_ms = float(low), float(high or low)
    if not 0 < low_ms <= high_ms:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW,HIGH in ms with 0 < LOW <= HIGH")
    return low_ms, high_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    parser.add_argument("--repeats", type=int, default=5, help="timed all-reduces per size (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed all-reduces first (default: %(default)s)")
    parser.add_argument("--after-compute-ms", type=compute_range_ms, metavar="LOW,HIGH",
                        help="compute for a time drawn between LOW and HIGH ms before each all-reduce instead of "
                             "meeting at a barrier")
    parser.add_argument("--seed", type=int, default=0, help="seed of the compute times (default: %(default)s)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    matrix = torch.randn(256, 256) / 16
    compute_times = random.Random(args.seed)  # seeded alike on every rank: the ranks draw the same times
    for size in (int(s) for s in args.sizes.split(",")):
        tensor = torch.ones(size // 4, dtype=torch.float32)
        started, finished = [], []
        for _ in range(args.warmup + args.repeats):
            if args.after_compute_ms:
                matrix = compute_for(compute_times.uniform(*args.after_compute_ms) / 1000, matrix)
            else:
                dist.barrier()  # both ranks start together, so the time is the all-reduce's, not the other's lateness
            started.append(time.perf_counter())
            dist.all_reduce(tensor)
            finished.append(time.perf_counter())
        # perf_counter is the machine's monotonic clock, shared by the ranks of a single-node run: from the later
        # rank's call (the collective cannot start before) to the later rank's finish (when it had finished).
        mine = torch.tensor([started, finished], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        later_call = torch.stack([t[0] for t in everyone]).max(dim=0).values
        later_finish = torch.stack([t[1] for t in everyone]).max(dim=0).values
        times = (later_finish - later_call)[args.warmup:].tolist()
        if rank == 0:
            print(json.dumps({"bytes": tensor.numel() * 4, "seconds": times,
                              "after_compute_ms": args.after_compute_ms}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
