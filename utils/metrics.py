"""Throughput and model FLOPs utilisation (MFU), the machine's load while tracing, and the metric sinks."""
import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Set

import torch

logger = logging.getLogger(__name__)

# Dense peak TFLOP/s per GPU from the vendors' data sheets: (bf16/fp16 tensor cores, tf32 tensor cores, fp32).
# First substring match of torch.cuda.get_device_name() wins, so specific names come before general ones.
PEAK_TFLOPS = [
    ("H200", (989.4, 494.7, 66.9)),
    ("H100 PCIe", (756.0, 378.0, 51.2)),
    ("H100 NVL", (835.0, 417.5, 60.0)),
    ("H100", (989.4, 494.7, 66.9)),       # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", (312.0, 156.0, 19.5)),
    ("L40S", (362.1, 183.2, 91.6)),
    ("L4", (121.0, 60.0, 30.3)),
    ("A10", (125.0, 62.5, 31.2)),
    ("V100", (125.0, None, 15.7)),        # fp16 only, no bf16/tf32
    ("T4", (65.0, None, 8.1)),            # fp16 only, no bf16/tf32
    ("RTX 4090", (165.2, 82.6, 82.6)),
]


def peak_flops_per_gpu(device: torch.device, precision: str, override_tflops: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of one GPU for this precision; None on CPU or for a GPU not in the table (MFU not shown)."""
    if device.type != "cuda":
        return None
    if override_tflops:
        return override_tflops * 1e12
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32, fp32) in PEAK_TFLOPS:
        if key in name:
            if precision in ("bf16", "fp16"):
                peak = half
            else:
                peak = tf32 if torch.get_float32_matmul_precision() != "highest" and tf32 else fp32
            return peak * 1e12 if peak else None
    logger.info("no peak FLOP/s known for %r: MFU not reported (pass --peak-tflops to set it)", name)
    return None


def count_parameters(model: torch.nn.Module) -> "tuple[int, int]":
    """(all parameters, parameters that do matmul work): position embeddings are lookups, not compute.

    Tied weights are counted once (parameters() deduplicates); the tied output projection is real compute.
    """
    total = position = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if name.endswith(("wpe.weight", "position_embeddings.weight")):
            position += param.numel()
    return total, total - position


def flops_per_token(compute_params: int, n_layer: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls forward and backward plus 12*L*H*T for attention scores
    (PaLM paper, appendix B; the estimate nanoGPT's MFU uses)."""
    return 6.0 * compute_params + 12.0 * n_layer * hidden * seq_len


# ---- machine load while tracing ----------------------------------------------------------------------------------
# Other processes using more than this share of the CPUs during the traced window make its step times unreliable:
# the same traced step measured 2.76 s and 0.22 s in two runs on a loaded machine.
BUSY_OTHER_CPU_SHARE = 0.25
PROC = Path("/proc")


@dataclass(frozen=True)
class LoadSample:
    """A snapshot of the machine's CPU use (Linux /proc; elsewhere the load average only)."""

    monotonic_s: float
    load_average: Optional[tuple]
    busy_cpu_s: Optional[float]                    # all CPUs' non-idle time since boot
    process_cpu_s: Dict[int, float] = field(default_factory=dict)   # this job's processes: user + system time
    job_pids: frozenset = frozenset()


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_cpu_ticks() -> Optional[tuple]:
    """All CPUs' user, nice, system, idle, iowait, irq, softirq and steal ticks since boot (/proc/stat's first line),
    or None where /proc/stat is missing."""
    try:
        fields = (PROC / "stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    values = [int(v) for v in fields[1:9]]
    return tuple(values + [0] * (8 - len(values)))


def _busy_cpu_seconds() -> Optional[float]:
    """user + nice + system + irq + softirq + steal of all CPUs, from /proc/stat's first line."""
    ticks = _machine_cpu_ticks()
    if ticks is None:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / _clock_ticks()


def interrupt_cpu_seconds() -> Optional[float]:
    """All CPUs' time in interrupt and softirq context since boot (/proc/stat; None where it is missing). A kernel
    with CONFIG_IRQ_TIME_ACCOUNTING keeps it out of the threads' CPU time; one without (the 2-core VM) counts it in
    the time of the thread it interrupted too. On a CPU run that is mostly the kernel's processing of the
    collectives' packets: over loopback on a 2-core VM 0.1-0.2 CPU-s per GB sent (segmentation offload on and
    off). /proc/stat counts it in clock ticks (10 ms): a difference over one step is off by up to a tick, a sum over
    consecutive steps by up to a tick in all."""
    ticks = _machine_cpu_ticks()
    if ticks is None:
        return None
    return (ticks[5] + ticks[6]) / _clock_ticks()


def idle_cpu_seconds() -> Optional[float]:
    """All CPUs' idle and iowait time since boot (/proc/stat; None where it is missing). Where the kernel stops the
    tick on idle CPUs (NO_HZ) it counts this exactly, not in ticks."""
    ticks = _machine_cpu_ticks()
    if ticks is None:
        return None
    return (ticks[3] + ticks[4]) / _clock_ticks()


def all_threads_cpu_seconds() -> Optional[dict]:
    """The time on a CPU of every thread the machine runs now, since each started, by thread id (Linux's
    /proc/<pid>/task/<tid>/schedstat; None where /proc has none). Over a window, threads_cpu_seconds_between gives
    what they ran in it. On a kernel without CONFIG_IRQ_TIME_ACCOUNTING this time holds the interrupts that came
    while each thread ran: over a quiet window the threads' time plus the idle time is then the CPUs' whole time."""
    times = {}
    for path in PROC.glob("[0-9]*/task/[0-9]*/schedstat"):
        seconds = schedstat_seconds(path)
        if seconds is not None:  # None: the thread ended while being read
            times[int(path.parent.name)] = seconds[0]
    return times or None


def threads_cpu_seconds_between(before: dict, after: dict) -> float:
    """What the threads ran between two all_threads_cpu_seconds readings: each thread's growth, the whole time of
    one that started in between, nothing for one that ended in between (its time in the window is not shown any
    more: a plain difference of sums would take its whole life's time off instead). A thread id used again by a
    new thread reads less than before: that thread started in between."""
    total = 0.0
    for tid, now in after.items():
        growth = now - before.get(tid, 0.0)
        total += growth if growth >= 0 else now  # below its reading before: a new thread with a used id
    return total


def schedstat_seconds(path) -> Optional[tuple]:
    """A Linux schedstat file in seconds: (time on a CPU, time runnable but waiting for one), both kept in ns; None
    where the file is missing or unreadable (not Linux, or the thread has ended)."""
    fields = schedstat_fields(path)
    return (fields[0] / 1e9, fields[1] / 1e9) if fields else None


def schedstat_fields(path) -> Optional[tuple]:
    """A Linux schedstat file as kept: (ns on a CPU, ns runnable but waiting for one, times given a CPU); None where
    the file is missing or unreadable (not Linux, or the thread has ended)."""
    try:
        with open(path, encoding="ascii") as stats:
            fields = stats.read().split()
        return int(fields[0]), int(fields[1]), int(fields[2])
    except (OSError, ValueError, IndexError):
        return None


def _processes() -> Dict[int, tuple]:
    """pid -> (parent pid, user + system CPU seconds) of every process /proc shows."""
    table, ticks = {}, _clock_ticks()
    for entry in PROC.iterdir() if PROC.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        after_name = text[text.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
        table[int(entry.name)] = (int(after_name[1]), (int(after_name[11]) + int(after_name[12])) / ticks)
    return table


def job_process_ids(processes: Dict[int, tuple]) -> Set[int]:
    """This process, its descendants, and under torchrun the agent and every rank it started on this machine."""
    roots = {os.getpid()}
    if os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("LOCAL_WORLD_SIZE"):
        roots.add(os.getppid())
    children: Dict[int, list] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    job, pending = set(), list(roots)
    while pending:  # iterative walk of the process tree
        pid = pending.pop()
        if pid not in job:
            job.add(pid)
            pending.extend(children.get(pid, ()))
    return job


def sample_machine_load() -> LoadSample:
    """Take one snapshot; two of them, around the traced window, go to machine_load_between()."""
    try:
        load = tuple(round(x, 2) for x in os.getloadavg())
    except (AttributeError, OSError):
        load = None
    processes = _processes()
    job = job_process_ids(processes) if processes else set()
    return LoadSample(monotonic_s=time.monotonic(), load_average=load, busy_cpu_s=_busy_cpu_seconds(),
                      process_cpu_s={pid: processes[pid][1] for pid in job if pid in processes},
                      job_pids=frozenset(job))


def machine_load_between(start: LoadSample, end: LoadSample) -> dict:
    """What the machine did besides this job between two samples, for run.json.

    other_processes_cpu_s is all CPUs' busy time less the CPU time of this job's processes (this rank, its
    torchrun agent and sibling ranks on this machine); other_processes_cpu_share divides it by the CPU time the
    window offered (seconds x CPUs). busy is True when that share exceeds BUSY_OTHER_CPU_SHARE.
    """
    window = max(end.monotonic_s - start.monotonic_s, 1e-9)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    report = {"window_s": round(window, 6), "cpus": cpus,
              "load_average_start": start.load_average, "load_average_end": end.load_average,
              "job_cpu_s": None, "other_processes_cpu_s": None, "other_processes_cpu_share": None, "busy": None}
    if start.busy_cpu_s is not None and end.busy_cpu_s is not None:
        job_cpu = sum(end.process_cpu_s[pid] - start.process_cpu_s.get(pid, 0.0) for pid in end.process_cpu_s)
        other = max(0.0, end.busy_cpu_s - start.busy_cpu_s - job_cpu)
        total_cpus = os.cpu_count() or cpus  # /proc/stat counts every CPU of the machine
        report.update(job_cpu_s=round(job_cpu, 3), other_processes_cpu_s=round(other, 3),
                      other_processes_cpu_share=round(other / (window * total_cpus), 4))
        report["busy"] = report["other_processes_cpu_share"] > BUSY_OTHER_CPU_SHARE
    elif end.load_average is not None:
        report["busy"] = end.load_average[0] > cpus
    return report


def busy_machine_warning(load: dict) -> Optional[str]:
    """One line for the log when other work shared the machine during the traced window, else None."""
    if not load.get("busy"):
        return None
    if load.get("other_processes_cpu_s") is not None:
        what = (f"other processes used {load['other_processes_cpu_s']:.2f} CPU-s of the {load['window_s']:.2f} s "
                f"window ({100 * load['other_processes_cpu_share']:.0f}% of the machine's CPUs)")
    else:
        what = f"load average {load['load_average_end'][0]} on {load['cpus']} CPUs"
    return (f"the machine was busy while the step was traced: {what}; its measured times may be inflated "
            "(trace again on an idle machine to compare)")


class MetricSinks:
    """Scalars to TensorBoard and/or W&B on rank 0; nothing on other ranks or with --report-to none."""

    def __init__(self, report_to: str, log_dir: Path, run_name: str, config: dict, enabled: bool):
        self.tensorboard = None
        self.tensorboard_dir: Optional[Path] = None
        self.wandb_run = None
        if not enabled or report_to == "none":
            return
        if report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("--report-to tensorboard but the tensorboard package is missing; pip install tensorboard")
                return
            # A folder per run, as transformers' runs/<date>: events of runs into one --log-dir (reruns, a run that
            # failed) in one folder are one curve to TensorBoard, drawn back and forth over the same steps
            started = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            self.tensorboard_dir = Path(log_dir) / "tensorboard" / run_name / f"{started}-{os.getpid()}"
            _quiet_tensorboard_writer_thread()
            try:
                self.tensorboard = SummaryWriter(log_dir=str(self.tensorboard_dir))
            except OSError as exc:
                self._tensorboard_failed(exc)
                return
            logger.info("TensorBoard: tensorboard --logdir %s", Path(log_dir) / "tensorboard")
        elif report_to == "wandb":
            try:
                import wandb
            except ImportError:
                logger.warning("--report-to wandb but the wandb package is missing; pip install wandb")
                return
            if not os.environ.get("WANDB_MODE") and not os.environ.get("WANDB_API_KEY"):
                # No credentials: record locally instead of prompting for a login; `wandb sync` uploads later.
                os.environ["WANDB_MODE"] = "offline"
                logger.info("W&B: no WANDB_API_KEY, logging offline under %s (upload later with `wandb sync`)", log_dir)
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.wandb_run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mosim-llms"), name=run_name,
                                        dir=str(log_dir), config=config)

    def log(self, scalars: dict, step: int) -> None:
        if self.tensorboard is not None:
            try:
                for key, value in scalars.items():
                    self.tensorboard.add_scalar(key, value, step)
            except OSError as exc:
                self._tensorboard_failed(exc)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            try:
                self.tensorboard.close()
            except OSError as exc:
                self._tensorboard_failed(exc)
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def _tensorboard_failed(self, exc: OSError) -> None:
        """A full or read-only log disk costs the TensorBoard curves, not the run (as for the log file)."""
        logger.warning("%s: cannot write TensorBoard events (%s); TensorBoard logging stopped, training goes on",
                       self.tensorboard_dir, exc.strerror or exc)
        writer, self.tensorboard = self.tensorboard, None
        if writer is not None:
            try:
                writer.close()
            except OSError:
                pass


_TENSORBOARD_THREAD = "_AsyncWriterThread"


def _quiet_tensorboard_writer_thread() -> None:
    """TensorBoard's writer thread re-raises a failed write, so Python prints its traceback; MetricSinks reports
    the same error in one line when the writer hands it on, so that thread's OSError is not printed again."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == _TENSORBOARD_THREAD:
            return
        previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook
