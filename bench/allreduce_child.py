"""One rank of the all-reduce micro-benchmark (started by torchrun): gloo all-reduce times of a few message sizes.

By default the ranks meet at a barrier before each timed all-reduce, so each starts on idle cores with gloo's threads
just woken. With --after-compute-ms LOW,HIGH, each rank computes instead, as a training step does before its
gradients' all-reduce, for a time drawn anew each repeat between LOW and HIGH ms (the same draw on every rank): a
fixed time would start every all-reduce at the same phase of the kernel's timer tick, and on a kernel that lets a
woken thread wait for the next tick the result would depend on that phase. The time counts from the later rank's
call.

With --cpu-times each size is instead reduced --repeats times back to back, and rank 0 prints the CPU time that
took: each rank's communication threads' (gloo's event loop and workers, as the tracer reads them, and how many
times they were given a CPU) and the
machine's interrupt and softirq time (/proc/stat), both over the whole loop, with the CPUs' whole time over it,
every thread's CPU time on the machine and the idle time: whether the threads' time already holds the interrupts
(bench/communication_cpu.py).
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from trace_tools.command_line import ArgumentParser
from utils.chakra_tracer import communication_threads_schedstat
from utils.collective_start import time_all_reduces
from utils.metrics import (all_threads_cpu_seconds, idle_cpu_seconds, interrupt_cpu_seconds,
                           threads_cpu_seconds_between)


def compute_range_ms(text: str) -> tuple:
    """--after-compute-ms's value: LOW,HIGH (or one number for both) in ms."""
    low, _, high = text.partition(",")
    low_ms, high_ms = float(low), float(high or low)
    if not 0 < low_ms <= high_ms:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW,HIGH in ms with 0 < LOW <= HIGH")
    return low_ms, high_ms


def machine_times(rank: int) -> tuple:
    """On rank 0 (the others: zeros): the monotonic clock, every thread's CPU time (by thread) and the CPUs' idle
    time, the clock at the middle of the reading (reading every thread's schedstat takes some ms)."""
    if rank != 0:
        return 0.0, {}, 0.0
    start = time.monotonic()
    threads, idle = all_threads_cpu_seconds(), idle_cpu_seconds()
    return (start + time.monotonic()) / 2, threads, idle


def print_cpu_times(tensor: torch.Tensor, repeats: int, warmup: int, rank: int) -> None:
    """Reduce `tensor` `repeats` times back to back (after `warmup`); rank 0 prints the wall time and the CPU time
    of every rank's communication threads and of the machine's interrupts over the loop, in seconds."""
    for _ in range(warmup):
        dist.all_reduce(tensor)
    dist.barrier()
    machine_before = machine_times(rank)
    threads_before, interrupts_before = communication_threads_schedstat(), interrupt_cpu_seconds()
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(tensor)
    dist.barrier()
    wall = time.perf_counter() - started
    threads_after, interrupts_after = communication_threads_schedstat(), interrupt_cpu_seconds()
    machine_after = machine_times(rank)
    if None in (threads_before, threads_after, interrupts_before, interrupts_after, *machine_before, *machine_after):
        raise SystemExit("error: this machine does not show threads' or interrupts' CPU time (/proc)")
    # the communication threads' ns on a CPU and times given a CPU over the loop
    mine = torch.tensor([threads_after[0] - threads_before[0], threads_after[2] - threads_before[2]],
                        dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    if rank == 0:
        print(json.dumps({"bytes": tensor.numel() * 4, "repeats": repeats, "wall_s": wall,
                          "communication_threads_cpu_s": [float(t[0]) / 1e9 for t in everyone],
                          "communication_threads_scheduled": [int(t[1]) for t in everyone],
                          "interrupt_cpu_s": interrupts_after - interrupts_before,
                          "cpus_time_s": (machine_after[0] - machine_before[0]) * (os.cpu_count() or 1),
                          "all_threads_cpu_s": threads_cpu_seconds_between(machine_before[1], machine_after[1]),
                          "idle_cpu_s": machine_after[2] - machine_before[2]}), flush=True)


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    parser.add_argument("--repeats", type=int, default=5, help="timed all-reduces per size (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed all-reduces first (default: %(default)s)")
    parser.add_argument("--after-compute-ms", type=compute_range_ms, metavar="LOW,HIGH",
                        help="compute for a time drawn between LOW and HIGH ms before each all-reduce instead of "
                             "meeting at a barrier")
    parser.add_argument("--seed", type=int, default=0, help="seed of the compute times (default: %(default)s)")
    parser.add_argument("--cpu-times", action="store_true",
                        help="reduce back to back and print the CPU time it took instead of each one's time")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for size in (int(s) for s in args.sizes.split(",")):
        tensor = torch.ones(size // 4, dtype=torch.float32)
        if args.cpu_times:
            print_cpu_times(tensor, args.repeats, args.warmup, rank)
            continue
        times = time_all_reduces(tensor, args.repeats, args.warmup, args.after_compute_ms, args.seed)
        if rank == 0:
            print(json.dumps({"bytes": tensor.numel() * 4, "seconds": times,
                              "after_compute_ms": args.after_compute_ms}), flush=True)
    dist.barrier()  # the ranks tear gloo down together: one alone aborts at exit at times
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
