"""A training loop of your own, traced for Chakra: a plain PyTorch MLP or CNN under DDP, not this project's trainer.

Everything the conversion needs comes from ChakraTracer (utils/chakra_tracer.py) used around the loop, with one
tracer.step() per optimizer step: host and device traces of the window, and run.json with the untraced steps that
the .et durations are corrected towards. Two CPU ranks, traced, then converted and simulated:

    torchrun --standalone --nproc_per_node=2 examples/own_training_loop.py --enable-tracing --trace-output-dir outputs
    python3 convert_to_et.py outputs/mlp_2r
    python3 simulate.py outputs/mlp_2r --bandwidth 10Gbit/s

docs/USAGE_GUIDE.md ("A training loop of your own") says what to take from it into yours.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trace_tools.command_line import ArgumentParser, path_argument
from utils.chakra_tracer import ChakraTracer, NullTracer
from utils.host_memory import keep_freed_memory_in_process
from utils.run_config import DEFAULT_ACTIVE_STEPS, DEFAULT_WARMUP_STEPS

logger = logging.getLogger("own_training_loop")
LOG_FILE = "training_rank_{rank}.log"  # in --log-dir, one per rank


def parse_args(argv: list[str] | None = None):
    parser = ArgumentParser(prog="examples/own_training_loop.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp",
                        help="mlp: linear layers and GELU; cnn: 3x3 convolutions with batch norm, whose running "
                             "statistics DDP broadcasts from rank 0 at every forward (default: %(default)s)")
    parser.add_argument("--width", type=int, default=1024,
                        help="hidden width (mlp) or channels (cnn) (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=6, help="hidden layers (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=16, help="cnn: input images of N x N (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples a step on each rank (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=14, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--log-dir", type=path_argument, default=None,
                        help=f"also write each rank's log to DIR/{LOG_FILE.format(rank='<rank>')}")
    parser.add_argument("--enable-tracing", action="store_true", help="trace a window of steps for Chakra")
    parser.add_argument("--trace-output-dir", type=path_argument, default="outputs",
                        help="parent folder of the trace folder (default: %(default)s)")
    parser.add_argument("--trace-name", default=None, help="the trace folder's name (default: <model>_<ranks>r)")
    parser.add_argument("--trace-wait-steps", type=int, default=4,
                        help="untraced steps timed before the window, the first left out (default: %(default)s)")
    parser.add_argument("--trace-warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS,
                        help="profiler warm-up steps (default: %(default)s)")
    parser.add_argument("--trace-active-steps", type=int, default=DEFAULT_ACTIVE_STEPS,
                        help="traced steps (default: %(default)s)")
    parser.add_argument("--trace-after-steps", type=int, default=None,
                        help="untraced steps timed after the window (default: as many as --trace-wait-steps)")
    args = parser.parse_args(argv)
    for flag in ("width", "layers", "image_size", "batch_size", "max_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: at least 1")
    window = args.trace_wait_steps + args.trace_warmup_steps + args.trace_active_steps
    if args.enable_tracing and args.max_steps <= window:
        parser.error(f"--max-steps {args.max_steps} ends the run inside the trace window (steps 1-{window}): "
                     f"give at least {window + 1}")
    return args


def build_model(kind: str, width: int, layers: int) -> nn.Module:
    """A 10-class classifier: `layers` hidden layers of `width` units (mlp) or channels (cnn)."""
    if kind == "mlp":
        hidden = [module for _ in range(layers) for module in (nn.Linear(width, width), nn.GELU())]
        return nn.Sequential(*hidden, nn.Linear(width, 10))
    hidden = [module for layer in range(layers) for module in (
        nn.Conv2d(3 if layer == 0 else width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())]
    return nn.Sequential(*hidden, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def setup_logging(rank: int, log_dir: str | None) -> None:
    handlers = [logging.StreamHandler(sys.stdout)] if rank == 0 else []
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(log_dir) / LOG_FILE.format(rank=rank), mode="w", encoding="utf-8"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=handlers or [logging.NullHandler()], force=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    setup_logging(rank, args.log_dir)
    train(args, rank, world_size, distributed)
    if distributed:
        # The DDP model is gone by now (train returned), as the trainer's Trainer.release() drops its own: released
        # after the group, DDP's reducer destroys the gloo group with the GIL held, joining gloo's thread while that
        # thread waits for the GIL to release the last all-reduce (each carries a Python object every backward()
        # stashes). That hung 2 of 10 runs of this loop at exit, and every run on a loaded machine
        dist.barrier()
        dist.destroy_process_group()
    return 0


def train(args, rank: int, world_size: int, distributed: bool) -> None:
    """The model, its optimizer and the traced loop, all released when this returns."""
    # Memory a step frees stays in the process for the next, so steps (and the traced ones) page-fault no fresh
    # memory and run at one pace: the project's trainers do the same (utils/host_memory.py says why)
    logger.info(keep_freed_memory_in_process())
    torch.manual_seed(0)  # the same initial weights on every rank
    torch.set_num_threads(1)  # one compute thread a rank, as the project's CPU runs

    model = build_model(args.model, args.width, args.layers)
    logger.info("%s parameters", f"{sum(p.numel() for p in model.parameters()):,}")
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    shape = (args.width,) if args.model == "mlp" else (3, args.image_size, args.image_size)
    inputs = torch.randn(args.batch_size, *shape, generator=generator)
    labels = torch.randint(0, 10, (args.batch_size,), generator=generator)

    tracer = NullTracer()
    if args.enable_tracing:
        tracer = ChakraTracer(args.trace_output_dir, args.trace_name or f"{args.model}_{world_size}r",
                              wait_steps=args.trace_wait_steps, warmup_steps=args.trace_warmup_steps,
                              active_steps=args.trace_active_steps, after_steps=args.trace_after_steps, rank=rank,
                              world_size=world_size, run_info={"model": args.model, "width": args.width,
                                                               "layers": args.layers, "batch_size": args.batch_size})
    with tracer:
        for step in range(1, args.max_steps + 1):
            wall, cpu = time.perf_counter(), time.process_time()
            loss = nn.functional.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # The tracer's own work at a step's end (the window's export, run.json) is not the step's
            own_wall, own_cpu = tracer.step()
            wall, cpu = time.perf_counter() - wall - own_wall, time.process_time() - cpu - own_cpu
            logger.info("step %d/%d | loss %.4f | %.1f ms/step | cpu %.1f ms/step", step, args.max_steps,
                        loss.item(), 1000 * wall, 1000 * cpu)
            tracer.start_step(after_own_work=True)  # the log line above is in no timed step


if __name__ == "__main__":
    sys.exit(main())
