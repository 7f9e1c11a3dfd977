"""One rank of the all-reduce micro-benchmark (started by torchrun): gloo all-reduce times of a few message sizes."""
import argparse
import json
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    parser.add_argument("--repeats", type=int, default=5, help="timed all-reduces per size (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed all-reduces first (default: %(default)s)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for size in (int(s) for s in args.sizes.split(",")):
        tensor = torch.ones(size // 4, dtype=torch.float32)
        times = []
        for index in range(args.warmup + args.repeats):
            dist.barrier()  # both ranks start together, so the time is the all-reduce's, not the other's lateness
            started = time.perf_counter()
            dist.all_reduce(tensor)
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's time: when the collective finished
            if index >= args.warmup:
                times.append(elapsed.item())
        if rank == 0:
            print(json.dumps({"bytes": tensor.numel() * 4, "seconds": times}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
