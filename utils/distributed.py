"""The torchrun environment and the process group: one process or DDP, NCCL on GPUs and gloo on CPUs."""
import contextlib
import datetime
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose: this module's functions take `group=group.WORLD` as a default,
# evaluated at import. Imported after init_process_group (the profiler and torch.compile import it through
# torch._dynamo), it holds the world group forever: destroy_process_group then leaves gloo's threads running into
# the interpreter's exit, where one releasing a finished collective's Python tensor aborts the rank ("terminate
# called without an active exception", exit -6) after a run that succeeded.
if dist.is_available():
    import torch.distributed.nn.functional  # noqa: F401

from utils.errors import UsageError

# gloo's words for a collective whose peer process is gone (killed, crashed): the connection to it closed
LOST_PEER_PATTERN = re.compile(r"Connection (closed|reset) by peer|Broken pipe")


def is_lost_peer_error(exc: BaseException | None) -> bool:
    """Whether `exc` is a collective that failed because another rank's process is gone (gloo: the connection
    closed or reset by the peer; torch.distributed.DistBackendError is a RuntimeError)."""
    return isinstance(exc, RuntimeError) and bool(LOST_PEER_PATTERN.search(str(exc)))


logger = logging.getLogger(__name__)

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the run. One process is rank 0 of a world of 1 with no process group."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: Optional[str]

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if not self.is_distributed:
            return
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (downloads, tokenizer training, caches); the others then reuse its result."""
        if not self.is_main_process:
            self.barrier()
        yield
        if self.is_main_process:
            self.barrier()

    def broadcast_object(self, value):
        """Rank 0's value on every rank (e.g. which data source it fell back to), so all ranks decide alike."""
        if not self.is_distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, value) -> list:
        if not self.is_distributed:
            return [value]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}={raw!r} is not an integer") from None


def read_torchrun_env() -> tuple:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) for a plain `python train.py`."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"RANK={rank} does not fit WORLD_SIZE={world_size}")
    return rank, local_rank, world_size


def check_num_gpus(num_gpus: Optional[int], world_size: int) -> None:
    """--num-gpus is the number of training processes the user expects (GPUs, or CPU ranks without CUDA)."""
    if num_gpus is None or num_gpus == world_size:
        return
    if world_size == 1:
        hint = f"launch with torchrun --nproc_per_node={num_gpus} ..."
    else:
        hint = f"pass --num-gpus {world_size} or start torchrun with --nproc_per_node={num_gpus}"
    raise UsageError(f"--num-gpus {num_gpus} but WORLD_SIZE is {world_size}: {hint}")


@contextlib.contextmanager
def distributed_context(num_gpus: Optional[int] = None) -> Iterator[DistributedContext]:
    """Set up this process's device and (under torchrun) the process group; always tear the group down.

    On success every rank meets at a barrier first, so no rank exits while another still writes a checkpoint.
    On an error there is no barrier (the other ranks may never reach it); destroying the group lets torchrun
    stop the rest.
    """
    rank, local_rank, world_size = read_torchrun_env()
    check_num_gpus(num_gpus, world_size)
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
                             "lower --nproc_per_node or check CUDA_VISIBLE_DEVICES")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = None
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT)
        except (RuntimeError, ValueError) as exc:
            raise UsageError(f"could not start the {backend} process group for rank {rank}/{world_size} "
                             f"({exc}); launch multi-process runs with torchrun") from exc
    ctx = DistributedContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device, backend=backend)
    succeeded = False
    try:
        yield ctx
        succeeded = True
    finally:
        if backend is not None and dist.is_initialized():
            if succeeded:
                ctx.barrier()
            dist.destroy_process_group()


USAGE_EXIT_STATUS = 2  # train.py's parser refusing a flag, on every rank, before anything is logged


def run_torchrun(argv: list) -> int:
    """torchrun (same arguments) that ends in one line instead of its launcher's tracebacks.

    On SIGTERM or Ctrl-C torchrun passes the signal to every rank (each saves a checkpoint and says where) and then
    raises SignalException; when a rank fails it raises ChildFailedError with a page-long report. Both become one
    `error:` line and the exit status a plain run would have.

    Without torchrun's own --log-dir, its per-rank folders (error files) go to a temporary folder removed when it
    ends: torchrun made a /tmp/torchelastic_* folder for every run and left it (850 of them on one machine).
    """
    from torch.distributed.elastic.multiprocessing import api as processes
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import main as torchrun_main
    processes._terminate_process_handler = _first_signal_only(processes._terminate_process_handler)
    # torchrun's own `E... failed (exitcode: N) local_rank: ...` line: the one-line error below says it
    logging.getLogger(processes.__name__).setLevel(logging.CRITICAL)
    own_log_dir = None
    if get_args_parser().parse_args(argv).log_dir is None:  # the trainer's --log-dir, after the script, is not it
        own_log_dir = tempfile.mkdtemp(prefix="torchelastic_")
        argv = ["--log-dir", own_log_dir, *argv]
    try:
        torchrun_main(argv)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"error: torchrun stopped by {name}: every rank was asked to save a checkpoint and stop "
              "(their lines above say where)", file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode == USAGE_EXIT_STATUS:  # refused its flags before it logged anything
            print(f"error: torchrun: rank {rank} (pid {failure.pid}) refused its flags (exit status 2); its message "
                  "is above", file=sys.stderr)
            return USAGE_EXIT_STATUS
        if failure.exitcode < 0:
            problem = f"was killed by {failure.signal_name()}"
        else:
            problem = f"stopped with exit status {failure.exitcode}"
        print(f"error: torchrun: rank {rank} (pid {failure.pid}) {problem}; its messages are above and in its "
              f"training_rank_{rank}.log in --log-dir", file=sys.stderr)
        return 1 if failure.exitcode >= 0 else 128 - failure.exitcode
    finally:
        if own_log_dir is not None:
            shutil.rmtree(own_log_dir, ignore_errors=True)
    return 0


def _first_signal_only(handler):
    """torchrun's signal handler, made to ignore every later signal once it has run: it passes the first one to the
    ranks, and a second one reaching torchrun while it waits for them (a launcher's SIGTERM just after the terminal's
    Ctrl-C reached the whole process group) made it send the ranks a second signal, which stops them at once, without
    the checkpoint the first one asked for. A second Ctrl-C at the terminal still reaches the ranks themselves."""
    def first_only(signum, frame):
        for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None), getattr(signal, "SIGQUIT", None)):
            if sig is not None and signal.getsignal(sig) is first_only:
                signal.signal(sig, signal.SIG_IGN)
        handler(signum, frame)
    return first_only


def buffers_change_in_training(model: torch.nn.Module) -> bool:
    """True when a module updates a buffer while training (BatchNorm's running statistics).

    GPT-2 and BERT only hold constant buffers (the causal mask, position and token type ids): broadcasting them
    from rank 0 before every forward, DDP's default, would put a BROADCAST of 12.6 MB (GPT-2 with transformers 4)
    into every traced step that the model's own training does not need.
    """
    return any(isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats
               for module in model.modules())


def wrap_data_parallel(model: torch.nn.Module, device: torch.device) -> torch.nn.parallel.DistributedDataParallel:
    """DDP over the process group; the only collectives of a step are then the gradient all-reduces (plus buffer
    broadcasts where buffers change in training)."""
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=buffers_change_in_training(model))
