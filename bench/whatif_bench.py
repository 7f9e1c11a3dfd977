"""What-if fidelity: ASTRA-sim's step from a traced run's .et against real 2-rank runs on rate-limited networks."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import sys
import textwrap
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.common import (BUNDLED_SQUAD, OUR_LOG_FILE, REPO_ROOT, STEP_CPU, STEP_LINE, BenchError,
                          WorkFolder, child_env, exit_on_sigterm, fail, foreign_checkout, format_table,
                          machine_description, our_step_times, quick_settings, run_child, source_revision, train_script)
from bench.netem import (DEFAULT_MTU, QUEUE_LATENCY, Namespace, NetemUnavailable, Rate, describe_queue,
                         expected_goodput_share, format_bits, measure_throughput, missing_requirement, parse_rate,
                         queue_counters)
from trace_tools.atomic import write_text_atomic
from trace_tools.command_line import ArgumentParser
from trace_tools.layout import RUN_INFO, et_name
from trace_tools.step_timing import read_step_times
from utils.run_config import DEFAULT_ACTIVE_STEPS, DEFAULT_WARMUP_STEPS

RANKS = 2  # the loopback is one medium shared by both directions; the per-link equivalence below is for 2 ranks
NICE = -5  # the measured ranks ahead of the other (nice 0 and 10) jobs on a shared machine
TRACE_NAME = "whatif_{model}_{rate}_{index}"
# Every step logs its time (--logging-steps 1), but the ranks agree on the loss only every 10th, as in a run with the
# trainer's default --logging-steps 10: that all-reduce and host read, every step, added ~2 ms to GPT-2 tiny's 31 ms
# step (alternating runs of 120 steps: 33.4 against 31.2 ms/step), and the traced window never has it.
LOSS_SYNC_STEPS = 10
DOCS = REPO_ROOT / "docs" / "BENCHMARKS.md"
DOCS_BEGIN, DOCS_END = "<!-- whatif:begin -->", "<!-- whatif:end -->"
MODEL_BEGIN, MODEL_END = "<!-- whatif:{key}:begin -->", "<!-- whatif:{key}:end -->"
MODEL_PART = re.compile(r"<!-- whatif:([\w.@/-]+):begin -->.*?<!-- whatif:\1:end -->", re.DOTALL)
GIB = 1 << 30  # ASTRA-sim analytical's GB
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")  # utils/trainer.py's file log format


@dataclass(frozen=True)
class ModelSetup:
    """One configuration the benchmark can run: trainer flags, step counts and the default rates."""

    key: str
    label: str
    model_name: str
    batch_size: int
    seq_length: int
    skip: int           # first steps of a run left out (allocator, caches, gloo connections)
    block: int          # steps at one rate before the untraced run moves on to the next
    settle: int         # steps left out after each change of rate (TCP windows, a full tbf bucket)
    cycles: int         # passes over all rates in one untraced run, alternating their order
    warmup_cycles: int  # passes before those, thrown away
    after_window_cycles: int  # passes over all rates in each traced run once its window has closed
    rates: tuple        # default network rates, from compute- to communication-dominated
    burst_slack_s: float  # tbf burst beyond one packet, as time at the rate (bench/netem.py says why)
    # Untraced runs, pooled. Before the trainer kept freed memory in the process (utils/host_memory.py) two processes
    # of one run differed in speed (the training thread's CPU time for the same 124M step: 7% standard deviation over
    # 24 processes); now 1.0%, but tiny's runs are short enough to pool three anyway.
    repeats: int
    timeout_s: int
    family: str = "gpt2"  # which trainer runs it: <family>/train.py (GPT-2's causal LM or BERT's masked LM)
    ranks: int = RANKS    # torchrun's processes (bench/scale_whatif.py runs more)
    accumulation: int = 1  # micro-batches an optimizer step (--gradient-accumulation-steps)
    compiled: bool = False  # the model under torch.compile (the trainer's --compile), traced and untraced alike
    cpus: tuple = ()      # the cores every rank is pinned to (none: all of them)
    # A training loop of its own in place of a family's trainer (a script of the repository): it takes the tracing
    # flags, --batch-size, --max-steps and --log-dir as the trainer does, its own model flags (script_args), and logs
    # one step line a step as the trainer does
    script: str = ""
    script_args: tuple = ()

    @property
    def program(self) -> str:
        """What trains the model, as the report names it."""
        if self.script:
            return " ".join([self.script, *(str(a) for a in self.script_args)])
        return f"{self.family}/train.py --model-name {self.model_name}"

    @property
    def batch(self) -> str:
        return f"batch {self.batch_size} x {self.seq_length} tokens" if self.seq_length else f"batch {self.batch_size}"


MODELS = {
    # The CPU quick runs' configuration (utils/launch/: tiny, batch 4, 128 tokens, one thread a rank).
    "tiny": ModelSetup("tiny", "GPT-2 tiny", "tiny", 4, 128, skip=10, block=10, settle=2, cycles=4,
                       warmup_cycles=1, after_window_cycles=2,
                       rates=("unthrottled", "1gbit", "400mbit", "100mbit"), burst_slack_s=250e-6, repeats=3,
                       timeout_s=900),
    # GPT-2 124M's layers (12 x 768, 12 heads) with the trainer's offline stand-in tokenizer (no --tokenizer-path):
    # 86.9M parameters. Its 348 MB of gradients take 2.8 s a step at 2 Gbit/s on the shared loopback (2 x 348 MB),
    # 11 s at 500 Mbit/s, against 1.5-6 s of compute (quiet to busy machine). Its ~14 buckets a step leave few idle
    # pauses, so a larger tbf burst costs little and keeps the busy rate at R.
    "gpt2-124m-shape": ModelSetup("gpt2-124m-shape", "GPT-2 124M shape (offline vocabulary)", "gpt2", 1, 128,
                                  skip=3, block=4, settle=1, cycles=4, warmup_cycles=1, after_window_cycles=2,
                                  rates=("unthrottled", "2gbit", "1gbit", "500mbit"),
                                  burst_slack_s=2e-3, repeats=1, timeout_s=3600),
    # A size between those two that no rule of the converter was read from (a `--model-name` folder: GPT-2's layout at
    # 6 x 384, 6 heads): 11.6M parameters with the offline stand-in vocabulary, ~0.4 s of compute a step at batch
    # 2 x 128 on a 2-core VM and 46 MB of gradients in two or three buckets, 0.4 s of transfer at 2 Gbit/s and 1.9 s
    # at 400 Mbit/s.
    "gpt2-6x384": ModelSetup("gpt2-6x384", "GPT-2 6 x 384 (offline vocabulary)", "bench/models/gpt2-6x384", 2, 128,
                             skip=5, block=6, settle=1, cycles=4, warmup_cycles=1, after_window_cycles=2,
                             rates=("unthrottled", "2gbit", "1gbit", "400mbit"), burst_slack_s=250e-6, repeats=2,
                             timeout_s=1800),
}
# BERT's masked LM through the same trainer: a model none of the converter's rules were read from. Its tiny size runs
# as GPT-2 tiny does and its base shape (12 x 768, offline vocabulary) as the 124M shape.
MODELS["bert-tiny"] = replace(MODELS["tiny"], key="bert-tiny", label="BERT tiny", family="bert")
MODELS["bert-base-shape"] = replace(MODELS["gpt2-124m-shape"], key="bert-base-shape",
                                    label="BERT base shape (offline vocabulary)", model_name="bert-base-uncased",
                                    family="bert")
# BERT's layout at the held-out 6 x 384 (intermediate 1536): 11.6M parameters with the offline vocabulary, as fast.
MODELS["bert-6x384"] = replace(MODELS["gpt2-6x384"], key="bert-6x384", label="BERT 6 x 384 (offline vocabulary)",
                               model_name="bench/models/bert-6x384", family="bert")
# A training loop that is not this project's trainer (examples/own_training_loop.py: a plain PyTorch MLP under DDP,
# traced with ChakraTracer around its loop): a model and a program no rule of the converter was read from. 6.3M
# parameters, ~65 ms of compute a step and 25 MB of gradients in two buckets: 31 ms of transfer unthrottled, 200 ms
# at 2 Gbit/s, 1 s at 400 Mbit/s.
MODELS["mlp"] = ModelSetup("mlp", "MLP 6 x 1024, a training loop of its own", "", 64, 0, skip=5, block=8,
                           settle=2, cycles=4, warmup_cycles=1, after_window_cycles=2,
                           rates=("unthrottled", "2gbit", "1gbit", "400mbit"), burst_slack_s=250e-6, repeats=2,
                           timeout_s=1200, family="", script="examples/own_training_loop.py",
                           script_args=("--width", 1024, "--layers", 6))
# The same loop's CNN: 6 layers of 3x3 convolutions with 96 channels and batch norm on 16 x 16 images, 0.4M
# parameters: ~0.1 s of compute a step, 1.7 MB of gradients in one bucket, and the batch norms' running statistics
# broadcast from rank 0 at every forward (DDP's broadcast_buffers), a collective before any compute of the step.
MODELS["cnn"] = replace(MODELS["mlp"], key="cnn", label="CNN 6 x 96 channels, a training loop of its own",
                        batch_size=16, skip=5, block=10, rates=("unthrottled", "1gbit", "400mbit", "100mbit"),
                        script_args=("--model", "cnn", "--width", 96, "--layers", 6, "--image-size", 16))
QUICK_RATES = ("unthrottled", "100mbit")
# --quick (a smoke test): the tiny model, two rates, one short pass, one 10 MB all-reduce; a flag given on the command
# line wins over its setting here
QUICK_SETTINGS = dict(model="tiny", rates=",".join(QUICK_RATES), traces=1, repeats=1, cycles=1, warmup_cycles=0,
                      after_window_cycles=1, block=5, settle=1, skip=3, micro_repeats=1, check_seconds=0.3,
                      micro_rate="100mbit", micro_sizes="10000000")
REPLAY_BAND, WHATIF_BAND = 0.05, 0.10  # issue 9's targets: a replay within 5% of the real step, another rate within 10%
RESULTS_FILE = "whatif_results.json"   # what a --keep folder records for bench/whatif_repredict.py
DRIFT_WARNING = 0.2  # block medians of one rate further apart than this: the report says the machine was unsteady
MICRO_SIZES = (10_000_000, 100_000_000)


# ------------------------------------------------------------------------------------------------ results
@dataclass
class RealRuns:
    """Step times at one rate, pooled over the segments of the interleaved untraced runs."""

    rate: Rate
    steps: list = field(default_factory=list)
    segment_ms: list = field(default_factory=list)  # median of each segment at this rate, in run order
    loads: list = field(default_factory=list)       # 1-minute load average when each segment began
    drops: int = 0
    stalls: list = field(default_factory=list)      # what lo's qdisc held each time it stalled at this rate
    cpu_segment_ms: list = field(default_factory=list)  # median CPU time per step of rank 0's process, each block

    @property
    def step_ms(self) -> float | None:
        """The real step: the mean of the block medians (None without a clean step). Each rate's blocks sit
        symmetrically in the run (the order alternates every cycle), so a load that rises or falls steadily during
        the run cancels out of this mean; within a block the median leaves out the odd step another job slowed
        down."""
        return statistics.fmean(self.segment_ms) if self.segment_ms else None

    @property
    def cpu_ms(self) -> float | None:
        """Rank 0's CPU time per step, as step_ms (None when the trainer's log has no CPU times)."""
        return statistics.fmean(self.cpu_segment_ms) if self.cpu_segment_ms else None

    @property
    def median_ms(self) -> float:
        return 1000 * statistics.median(self.steps)

    @property
    def drift(self) -> float:
        """How far apart this rate's block medians are, relative to their mean (0 for a steady machine)."""
        return (max(self.segment_ms) - min(self.segment_ms)) / self.step_ms

    def spread(self) -> str:
        ordered = sorted(self.steps)
        low, high = ordered[int(0.1 * (len(ordered) - 1))], ordered[round(0.9 * (len(ordered) - 1))]
        return f"{1000 * low:,.1f}-{1000 * high:,.1f}"


@dataclass
class TracedRun:
    """One traced run at the trace rate and its conversion."""

    index: int
    rate: Rate
    folder: Path
    traced_ms: float | None = None            # the tracer's own time of the traced step(s) (run.json)
    untraced_ms: float | None = None          # run.json untraced_step_wall_time_s, when the tracer records it
    before_window_ms: float | None = None     # the trainer's log, steps before the window
    before_window_cpu_ms: float | None = None  # rank 0's CPU time per step in the same steps: the .et's compute
    # The same process's untraced steps at every rate once the window has closed: rate label -> RealRuns
    after_window: dict = field(default_factory=dict)
    load: tuple = ()
    parameters: int | None = None
    predictions: dict = field(default_factory=dict)   # rate label -> SimulationResult


@dataclass
class Simulator:
    """ASTRA-sim through trace_tools.simulate, or why it cannot run."""

    module: object = None
    binary: Path | None = None
    missing: str = ""

    @property
    def ok(self) -> bool:
        return self.module is not None and self.binary is not None


# -------------------------------------------------------------------------------------------- bandwidths
def link_gbs(bits_per_s: float, ranks: int = RANKS) -> float:
    """A rate through the shared loopback as the per-link bandwidth of a ring of `ranks` NPUs, in ASTRA-sim's GB/s.

    A ring all-reduce of S bytes on 2 ranks sends S bytes each way, 2S through lo's one qdisc: time 2S/R. On a
    2-NPU ring with per-link bandwidth B, each NPU sends 2(n-1)/n S = S bytes: time S/B. So B = R/2. On N ranks
    every rank sends 2(N-1)/N S, 2(N-1)S through the qdisc (time 2(N-1)S/R), and B = R/N gives the ring the same.
    """
    return bits_per_s / ranks / 8 / GIB


def ring_allreduce_s(size: int, bits_per_s: float) -> float:
    return 2 * size * 8 / bits_per_s


# -------------------------------------------------------------------------------------------- the simulator
def find_simulator(path: str | None) -> Simulator:
    """trace_tools.simulate and the ASTRA-sim binary (--astra-sim, else $ASTRA_SIM), or the reason there are none."""
    try:
        from trace_tools import simulate
    except ImportError as exc:
        return Simulator(missing=f"trace_tools.simulate is not in this checkout ({exc})")
    try:
        return Simulator(simulate, simulate.find_astra_sim(path))
    except Exception as exc:  # SimulationError: the one line says what to do
        return Simulator(missing=str(exc))


def write_allreduce_et(prefix: Path, size: int, ranks: int = RANKS) -> Path:
    """A workload of one ALL_REDUCE of `size` bytes on `ranks` ranks: <prefix>.<rank>.et, as trace_tools/convert.py
    writes."""
    from chakra.schema.protobuf.et_def_pb2 import ALL_REDUCE, COMM_COLL_NODE, AttributeProto, GlobalMetadata, Node
    from chakra.src.third_party.utils.protolib import encodeMessage

    prefix.parent.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        node = Node(id=1, name="all_reduce", type=COMM_COLL_NODE)
        node.attr.extend([AttributeProto(name="is_cpu_op", bool_val=False),
                          AttributeProto(name="comm_type", int64_val=ALL_REDUCE),
                          AttributeProto(name="comm_size", int64_val=size)])
        with open(et_name(str(prefix), rank), "wb") as f:
            encodeMessage(f, GlobalMetadata(version="0.0.4"))
            encodeMessage(f, node)
    return prefix


# ------------------------------------------------------------------------------------------- child commands
def torchrun(ns: Namespace, script: Path, args: list, ranks: int = RANKS) -> list:
    """`ranks` ranks of `script` under torchrun inside the namespace, niced ahead of the machine's other jobs."""
    nice = shutil.which("nice")
    return ns.command([nice, "-n", str(NICE), sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={ranks}", script, *args])


def train_args(setup: ModelSetup, work: Path, steps: int | None) -> list:
    if setup.script:
        return [*setup.script_args, "--batch-size", setup.batch_size, "--log-dir", work / "logs",
                *(["--max-steps", steps] if steps is not None else [])]
    args = ["--model-name", setup.model_name, "--squad-file", BUNDLED_SQUAD, "--batch-size", setup.batch_size,
            "--max-seq-length", setup.seq_length, "--num-gpus", setup.ranks, "--precision", "fp32",
            "--compile" if setup.compiled else "--no-compile",
            "--logging-steps", "1", "--loss-sync-steps", LOSS_SYNC_STEPS, "--eval-steps", "0", "--eval-batches", "1",
            "--save-steps", "0", "--no-save-initial", "--save-dir", work / "checkpoints", "--log-dir", work / "logs",
            "--report-to", "none"]
    if setup.accumulation > 1:
        args += ["--gradient-accumulation-steps", setup.accumulation]
    if steps is not None:
        args += ["--max-steps", steps]
    return args


def load1() -> float:
    return os.getloadavg()[0]


def run_training(ns: Namespace, setup: ModelSetup, work: Path, env: dict, extra: list, steps: int | None,
                 what: str, fresh: bool = True) -> tuple:
    """One training run of setup.ranks ranks in the namespace (on setup.cpus when given); its step times (rank 0's
    log) and the load before/after."""
    if fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    before = load1()
    script = REPO_ROOT / setup.script if setup.script else train_script(setup.family)
    run = run_child(torchrun(ns, script, train_args(setup, work, steps) + extra, setup.ranks),
                    env=env, cpus=setup.cpus, timeout_s=setup.timeout_s)
    after = load1()
    shutil.rmtree(work / "checkpoints", ignore_errors=True)  # the final model: 0.35 GB for the 124M shape
    if not run.ok:
        # A run that hung on the network says what lo's queue held: a stalled tbf keeps its packets forever.
        queue = ns.queue_state() if ns.rate is not None and ns.rate.throttled else ""
        raise BenchError(f"{what} failed: {run.reason()}" + (f" ({queue}, at {ns.rate.label})" if queue else ""))
    return our_step_times(work / "logs"), (before, after)


def parameter_count(log_dir: Path) -> int | None:
    text = (log_dir / OUR_LOG_FILE).read_text(encoding="utf-8", errors="replace")
    match = re.search(r"([0-9][0-9,]*) parameters", text)
    return int(match.group(1).replace(",", "")) if match else None


# ------------------------------------------------------------------------------------------------- phases
def verify_rates(ns: Namespace, rates: list, seconds: float) -> tuple:
    """Payload throughput of one TCP stream at every rate (tbf's achieved rate): the table rows and each rate's
    payload bits/s by label."""
    rows, payload = [], {}
    for rate in rates:
        ns.set_rate(rate)
        bits = payload[rate.label] = measure_throughput(ns, seconds)
        if rate.throttled:
            expected = rate.bits_per_s * expected_goodput_share(ns.mtu)
            burst = rate.burst_bytes(ns.mtu, ns.burst_slack_s)
            rows.append([rate.label, f"{burst:,}", f"{1000 * burst * 8 / rate.bits_per_s:.2f}",
                         f"{bits / 1e6:,.1f}", f"{bits / rate.bits_per_s:.3f}x", f"{bits / expected:.3f}x",
                         ns.drops()])
        else:
            rows.append([rate.label, "-", "-", f"{bits / 1e6:,.1f}", "-", "-", 0])
        print(f"    {rate.label}: {format_bits(bits)} payload", flush=True)
    return rows, payload


def simulated_rates(rates: list, payload: dict, unthrottled_bits: float) -> dict:
    """The bits/s each rate is simulated at, by label: what the network carries of a collective's bytes.

    ASTRA-sim's links move payload: no packet headers, no acknowledgements. Through tbf at rate R a TCP stream gets
    R less its headers and its acknowledgements' share of the same qdisc (0.989-0.994 R at MTU 9000), and a gloo
    all-reduce of S bytes takes 2S over that payload rate, not over R (the micro-benchmark's real / ring column).
    So a throttled rate is simulated at the payload rate the tbf check measured through it, as the unthrottled
    rate is the payload rate of a gloo all-reduce.
    """
    return {r.label: payload[r.label] if r.throttled else unthrottled_bits for r in rates}


def micro_benchmark(ns: Namespace, rate: Rate, sizes: tuple, repeats: int, env: dict, sim: Simulator,
                    scratch: Path, latency_ns: float, unthrottled: bool, payload_bits: float) -> tuple:
    """gloo all-reduce times at `rate` (and unthrottled), ASTRA-sim's at payload_bits (the payload rate measured
    through `rate`); table rows and the unthrottled effective rate (or None)."""
    rows, effective = [], None
    for current in (rate, Rate("unthrottled", None)) if unthrottled else (rate,):
        ns.set_rate(current)
        run = run_child(torchrun(ns, REPO_ROOT / "bench" / "allreduce_child.py",
                                 ["--sizes", ",".join(map(str, sizes)), "--repeats", repeats]),
                        env=env, timeout_s=1800)
        if not run.ok:
            raise BenchError(f"all-reduce micro-benchmark at {current.label} failed: {run.reason()}")
        results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        for result in results:
            size, real = result["bytes"], statistics.median(result["seconds"])
            if current.throttled:
                ring = ring_allreduce_s(size, current.bits_per_s)
                simulated = simulate_allreduce(sim, size, payload_bits, scratch, latency_ns)
                rows.append([current.label, f"{size / 1e6:g}", len(result["seconds"]), f"{1000 * real:,.1f}",
                             f"{1000 * ring:,.1f}", f"{real / ring:.3f}x",
                             f"{1000 * simulated:,.1f}" if simulated else "n/a",
                             f"{simulated / real:.3f}x" if simulated else "n/a"])
            else:
                effective = 2 * size * 8 / real  # the largest size is last: the least start-up in it
                rows.append([current.label, f"{size / 1e6:g}", len(result["seconds"]), f"{1000 * real:,.1f}",
                             f"(2S/t = {format_bits(effective)})", "-", "-", "-"])
        print(f"    {current.label}: " + ", ".join(f"{r['bytes'] / 1e6:g} MB {1000 * statistics.median(r['seconds']):,.1f} ms"
                                                  for r in results), flush=True)
    return rows, effective


def simulate_allreduce(sim: Simulator, size: int, bits_per_s: float, scratch: Path, latency_ns: float) -> float | None:
    if not sim.ok:
        return None
    prefix = write_allreduce_et(scratch / f"allreduce_{size}" / "allreduce", size)
    result = sim.module.simulate_workload(prefix, RANKS, bandwidth_gbs=link_gbs(bits_per_s), latency_ns=latency_ns,
                                          binary=sim.binary, work_dir=prefix.parent / "astra-sim")
    return result.step_ms / 1000


def traced_run(ns: Namespace, setup: ModelSetup, rate: Rate, index: int, args, env: dict, root: Path,
               rates: list) -> TracedRun:
    """Traced run number `index` at `rate`, converted to .et files. With --after-window-cycles, the run goes on
    untraced once its window has closed (the first step line of rank 0's log without the window's note) and the
    tracer has timed its untraced steps after it, changing the rate as the untraced run does: the same process's
    real steps at every rate, so a prediction can also be set against the run it came from, apart from how the
    machine's speed changed between processes."""
    ns.set_rate(rate)
    schedule = [rate] + cycle_schedule(rates, args.after_window_cycles)
    window_end = args.trace_wait_steps + DEFAULT_WARMUP_STEPS + (args.trace_active_steps or DEFAULT_ACTIVE_STEPS)
    name = TRACE_NAME.format(model=setup.key, rate=label_slug(rate.label), index=index)
    work = root / f"traced-{index}"
    folder = work / "traces" / name
    after_steps = args.trace_wait_steps  # untraced steps the tracer times after its window, as many as before it
    extra = ["--enable-tracing", "--trace-output-dir", work / "traces", "--trace-name", name,
             "--trace-wait-steps", args.trace_wait_steps, "--trace-after-steps", after_steps]
    if args.trace_active_steps:
        extra += ["--trace-active-steps", args.trace_active_steps]
    what, after_window, log = f"traced run {index + 1} at {rate.label}", {}, work / "logs" / OUR_LOG_FILE
    if len(schedule) == 1:
        # the trainer runs an epoch; a loop of its own as many steps as the tracer times
        steps = window_end + after_steps + 1 if setup.script else None
        times, load = run_training(ns, setup, work, env, extra, steps, what)
        cpu = step_cpu(log)
    else:
        # The steps right after the window stay at the trace rate: the tracer times them as untraced steps of the
        # traced run, and one more, left out, ends before the change.
        at_trace_rate = max(args.settle, after_steps) + 1
        steps = window_end + at_trace_rate + (len(schedule) - 1) * args.block + 1

        def traced_attempt() -> tuple:
            shutil.rmtree(work, ignore_errors=True)
            cycler = RateCycler(ns, schedule, at_trace_rate, args.block, log, window_end=window_end)
            return cycler, cycled_run(ns, setup, work, env, extra, steps, cycler, what)

        cycler, (times, load) = once_more_on_failure(traced_attempt)
        cpu = step_cpu(log)
        after_window = {r.label: RealRuns(r) for r in rates}
        add_blocks(after_window, cycler.switches, timed_steps(log), ns.drops(), first_measured=1,
                   skip=window_end, settle=args.settle, stalls=cycler.stalls, cpu=cpu)
    run = TracedRun(index, rate, folder, load=load, parameters=parameter_count(work / "logs"),
                    after_window=after_window)
    skip = min(args.skip, args.trace_wait_steps - 1)
    before = [times[s] for s in range(skip + 1, args.trace_wait_steps + 1) if s in times]
    run.before_window_ms = 1000 * statistics.median(before) if before else None
    before_cpu = [cpu[s] for s in range(skip + 1, args.trace_wait_steps + 1) if s in cpu]
    run.before_window_cpu_ms = 1000 * statistics.median(before_cpu) if before_cpu else None
    run.traced_ms, run.untraced_ms = read_run_json(folder)
    convert(folder, env)
    print(f"    trace {index + 1}: traced step {fmt_ms(run.traced_ms)} ms, steps before the window "
          f"{fmt_ms(run.before_window_ms)} ms (cpu {fmt_ms(run.before_window_cpu_ms)} ms); converted", flush=True)
    for entry in run.after_window.values():
        print(f"      after the window, {entry.rate.label}: {fmt_ms(entry.step_ms)} ms/step, cpu "
              f"{fmt_ms(entry.cpu_ms)} ms/step ({len(entry.steps)} steps)", flush=True)
    return run


def read_run_json(folder: Path) -> tuple:
    """(traced step ms, untraced step ms or None) from the tracer's run.json. The untraced step is the slower rank's
    median over the steps the converter corrects each rank towards (trace_tools.step_timing: the run's first step,
    with its one-time start-up costs, left out). Not the median of each step's slower rank: the ranks meet in every
    step's all-reduces but each times its step from its own boundary, so a late boundary makes one rank's step
    long and its next one short, and a step-by-step maximum takes every long half (on the device machine's CPU,
    1,803 ms a step where the ranks' own medians were 1,684 and 1,748)."""
    path = folder / RUN_INFO
    if not path.is_file():
        raise BenchError(f"{path}: the tracer wrote no run.json")
    info = json.loads(path.read_text(encoding="utf-8"))
    traced = info.get("step_wall_time_s_max") or []
    ranks = [read_step_times(folder, r["rank"]) for r in info.get("ranks", []) if isinstance(r, dict) and "rank" in r]
    untraced = [statistics.median(times.untraced_us) / 1e3 for times in ranks if times and times.untraced_us]
    return (1000 * statistics.median(traced) if traced else None, max(untraced) if untraced else None)


class RateCycler(threading.Thread):
    """Moves lo to the next rate of `schedule` every `block` steps of a running trainer (rank 0's log), and
    records when each rate took effect. The first change comes `first_block` steps into the run or, in a traced
    run, `first_block` steps from its window's last step on (`window_end`, as the log numbers it; that step counts:
    the tracer exports the window in it). The steps are counted by their lines, one a step (--logging-steps 1),
    so any training script whose lines read as our trainer's can be cycled.

    It also clears a stalled tbf: once no step line has come for `stall_after_s` plus three typical steps (the
    median so far), it reads lo's qdisc, and if the qdisc holds packets and has sent nothing `stall_check_s` later,
    it replaces the qdisc by a new one of the same rate (TCP sends the dropped packets again). A run once hung 14
    minutes that way, at a change from 1 Gbit/s to 400 Mbit/s. Every stall the kept runs recorded (15, 2026-11-27
    and -28) came in the first block after tc had lowered the rate of the qdisc in place: its sent count was one or
    two blocks' traffic. The look is harmless on a working link, which sends something every second at any rate the
    bench sets. So the wait need not outlast the slowest step so far; the slowest was the stall's own step after a
    first stall, and the second stall of one run waited 67 s where the first had waited 14 s. bench/netem.py now
    puts a new tbf on lo at every change of rate, and with that none stalled in 400 blocks of gloo traffic
    (bench/tbf_stalls.py); the look stays for a stall of another cause."""

    def __init__(self, ns: Namespace, schedule: list, first_block: int, block: int, log_path: Path,
                 window_end: int = 0, stall_after_s: float = 2.0, stall_check_s: float = 1.0):
        super().__init__(daemon=True)
        self.ns, self.schedule, self.block, self.log_path = ns, schedule, block, log_path
        self.boundary = first_block + (window_end - 1 if window_end else 0)  # step lines read before the change
        self.seen = 0  # step lines read so far
        self.stall_after_s, self.stall_check_s = stall_after_s, stall_check_s
        self.stalls = []  # (wall clock when the qdisc was replaced, rate, what it held)
        self.switches = []  # (wall clock after tc returned, rate, load, drops of the previous rate)
        self.finished = threading.Event()
        self.error = None

    def start_first(self) -> None:
        self.ns.set_rate(self.schedule[0])
        self.switches.append((time.time(), self.schedule[0], load1(), 0))
        self.start()

    def run(self) -> None:
        try:
            index, offset, tail = 0, 0, ""
            last_line, step_s, typical_s = time.monotonic(), [], 0.0
            while not self.finished.wait(0.02):
                if time.monotonic() - last_line > self.stall_after_s + 3 * typical_s:
                    self.clear_stall()
                    last_line = time.monotonic()
                if not self.log_path.is_file():
                    continue
                with open(self.log_path, encoding="utf-8", errors="replace") as log:
                    log.seek(offset)
                    tail += log.read()
                    offset = log.tell()
                lines, tail = tail.rsplit("\n", 1) if "\n" in tail else ("", tail)
                for line in lines.splitlines():
                    match = STEP_LINE.search(line)
                    if not match:
                        continue
                    last_line = time.monotonic()
                    step_s.append(float(match.group(3).replace(",", "")) / 1000)
                    typical_s = statistics.median(step_s)
                    self.seen += 1
                if index + 1 < len(self.schedule) and self.seen >= self.boundary:
                    drops = self.ns.drops()
                    index += 1
                    self.ns.set_rate(self.schedule[index])
                    self.switches.append((time.time(), self.schedule[index], load1(), drops))
                    self.boundary += self.block
        except Exception as exc:  # reported by the caller after the run
            self.error = exc

    def clear_stall(self) -> None:
        """Replace lo's qdisc when it holds packets and sends none (see the class)."""
        rate = self.ns.rate
        if rate is None or not rate.throttled:
            return
        before = queue_counters(self.ns.queue_stats())
        if not before or not before[1]:
            return
        time.sleep(self.stall_check_s)
        shown = self.ns.queue_stats()
        after = queue_counters(shown)
        if not after or not after[1] or after[0] != before[0]:
            return
        self.ns.reset_rate()
        held = describe_queue(shown)
        self.stalls.append((time.time(), rate, held))
        print(f"    lo's tbf at {rate.label} stalled ({held}); replaced by a new one", flush=True)


def timed_steps(log_path: Path) -> list:
    """(step, start, end) in wall-clock seconds from rank 0's log: each step line's time stamp is its end."""
    steps = []
    for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines():
        match = STEP_LINE.search(line)
        stamp = LOG_TIME.match(line)
        if match and stamp:
            end = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            seconds = float(match.group(3).replace(",", "")) / 1000
            steps.append((int(match.group(1)), end - seconds, end))
    return steps


def step_cpu(log_path: Path) -> dict:
    """{step: CPU seconds of rank 0's process in that step} from the step lines of rank 0's log that carry it."""
    cpu = {}
    for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines():
        match, spent = STEP_LINE.search(line), STEP_CPU.search(line)
        if match and spent:
            cpu[int(match.group(1))] = float(spent.group(1).replace(",", "")) / 1000
    return cpu


def cycle_schedule(rates: list, cycles: int) -> list:
    """The rates of `cycles` passes, the order alternating each pass (A B C | C B A | ...), so a load that rises or
    falls steadily during a run weighs on every rate alike."""
    return [rate for cycle in range(cycles) for rate in (rates if cycle % 2 == 0 else rates[::-1])]


def once_more_on_failure(attempt):
    """attempt(), and once more if it fails. On a rate-limited loopback torchrun's own store talks through the same
    tbf, and a stalled tbf (replaced by RateCycler) can cost a run its store connection: two of five tiny bench runs
    on 2026-11-27 lost an untraced run that way (RendezvousConnectionError, after stalls at 400 Mbit/s), and with it
    the whole benchmark. A second failure is the benchmark's error."""
    try:
        return attempt()
    except BenchError as error:
        print(f"    {error}; running it once more", flush=True)
        return attempt()


def cycled_run(ns: Namespace, setup: ModelSetup, work: Path, env: dict, extra: list, steps: int,
               cycler: RateCycler, what: str) -> tuple:
    """A training run of `steps` steps while `cycler` changes lo's rate; its step times and load, as run_training.
    Every change of the cycler's schedule must have happened."""
    cycler.start_first()
    try:
        result = run_training(ns, setup, work, env, extra, steps, what, fresh=False)
    finally:
        cycler.finished.set()
        cycler.join()
    if cycler.error:
        raise BenchError(f"changing the rate during the {what} failed: {cycler.error}")
    if len(cycler.switches) != len(cycler.schedule):
        raise BenchError(f"{what}: {len(cycler.switches)} of {len(cycler.schedule)} rate changes happened; the "
                         "trainer's log was not followed")
    return result


def add_blocks(results: dict, switches: list, steps: list, end_drops: int, first_measured: int, skip: int,
               settle: int, stalls: list = (), cpu: dict | None = None) -> None:
    """Add each block of a cycled run to results (rate label -> RealRuns): the steps after `skip` that began after
    the block's rate took effect and ended before the next change, less the first `settle` of them; the blocks
    before `first_measured` are left out. `switches` and `stalls` are the cycler's, `steps` timed_steps' of the
    run's log; a step during which a stalled qdisc was replaced is left out, and the stall noted at its rate.
    `cpu` (step_cpu's) gives the same blocks' CPU time per step."""
    for _, rate, held in stalls:
        if rate.label in results:
            results[rate.label].stalls.append(held)
    steps = [(step, start, end) for step, start, end in steps if not any(start <= when <= end for when, _, _ in stalls)]
    windows = switches + [(math.inf, None, None, end_drops)]
    # Where the order turns round (... B A | A B ...) a block repeats its predecessor's rate: nothing changed
    # there, so no step straddles it and none needs to settle.
    rate_since = 0.0
    for index, ((began, rate, load, _), (ended, _, _, drops)) in enumerate(zip(windows, windows[1:])):
        changed = index == 0 or windows[index - 1][1] != rate
        rate_since = began if changed else rate_since
        if index < first_measured:
            continue
        inside = [(step, end - start) for step, start, end in steps
                  if step > skip and start >= rate_since and began <= end <= ended]
        kept = inside[settle:] if changed else inside
        entry = results[rate.label]
        entry.loads.append(load)
        entry.drops += drops
        if kept:
            entry.steps += [seconds for _, seconds in kept]
            entry.segment_ms.append(1000 * statistics.median(seconds for _, seconds in kept))
            spent = [cpu[step] for step, _ in kept if step in cpu] if cpu else []
            if spent:
                entry.cpu_segment_ms.append(1000 * statistics.median(spent))


def real_run(ns: Namespace, setup: ModelSetup, rates: list, repeat: int, args, env: dict, root: Path,
             results: dict) -> None:
    """Untraced run number `repeat`, its steps added to `results` (rate label -> RealRuns). It cycles through the
    rates in blocks of steps, alternating the order each cycle, so a machine getting busier or quieter during the
    run weighs on every rate alike. The first `warmup_cycles` cycles are thrown away (the first blocks of a run
    came out up to 2x slower at every rate: the trainer, gloo's sockets and the machine settling). A step counts
    for a rate when it began after that rate took effect and ended before the next change; the first `settle` such
    steps of each block are left out too."""
    schedule = cycle_schedule(rates, args.warmup_cycles + args.cycles)
    total = args.skip + len(schedule) * args.block + 1  # one more step: the last block ends cleanly
    work = root / f"real-{repeat}"

    def untraced_attempt() -> RateCycler:
        shutil.rmtree(work, ignore_errors=True)
        cycler = RateCycler(ns, schedule, args.skip + args.block, args.block, work / "logs" / OUR_LOG_FILE)
        cycled_run(ns, setup, work, env, [], total, cycler,
                   f"untraced run {repeat + 1} (rates changing every {args.block} steps)")
        return cycler

    cycler = once_more_on_failure(untraced_attempt)
    add_blocks(results, cycler.switches, timed_steps(work / "logs" / OUR_LOG_FILE), ns.drops(),
               first_measured=args.warmup_cycles * len(rates), skip=args.skip, settle=args.settle,
               stalls=cycler.stalls, cpu=step_cpu(work / "logs" / OUR_LOG_FILE))
    for entry in results.values():
        print(f"    {entry.rate.label}: {fmt_ms(entry.step_ms)} ms/step, cpu {fmt_ms(entry.cpu_ms)} ms/step (mean "
              f"of the block medians {', '.join(f'{ms:,.0f}' for ms in entry.segment_ms)}; {len(entry.steps)} "
              "steps)", flush=True)


def run_order(traces: int, repeats: int) -> list:
    """The order of the traced ("traced", i) and untraced ("untraced", j) runs: each kind spread evenly over the
    benchmark's time (run k of n at (k + 1/2) / n, a traced run first on a tie), so the machine's speed drifting
    over minutes weighs on the traces and on the untraced runs they are set against alike. Three of each
    alternate, traced first; three traces and one untraced run put it in the middle."""
    slots = [((index + 0.5) / traces, 0, "traced", index) for index in range(traces)]
    slots += [((repeat + 0.5) / repeats, 1, "untraced", repeat) for repeat in range(repeats)]
    return [(kind, number) for _, _, kind, number in sorted(slots)]


def interleaved_runs(ns: Namespace, setup: ModelSetup, trace_rate: Rate, rates: list, args, env: dict,
                     root: Path, on_run_done=None) -> tuple:
    """(traced runs, untraced results by rate label) of --traces traced runs at trace_rate and --repeats untraced
    runs, in run_order's order. After each run, on_run_done(traces, real, Progress) if given."""
    traces, real = [], {rate.label: RealRuns(rate) for rate in rates}
    untraced_done = 0
    for kind, number in run_order(args.traces, args.repeats):
        if kind == "traced":
            phase(f"traced run {number + 1} of {args.traces} at {trace_rate.label}")
            traces.append(traced_run(ns, setup, trace_rate, number, args, env, root, rates))
        else:
            phase(f"untraced run {number + 1} of {args.repeats}")
            real_run(ns, setup, rates, number, args, env, root, real)
            untraced_done += 1
        if on_run_done:
            on_run_done(traces, real, Progress(len(traces), args.traces, untraced_done, args.repeats))
    missing = [label for label, entry in real.items() if not entry.steps]
    if missing:
        raise BenchError(f"no clean step at {', '.join(missing)}: every step straddled a rate change; raise --block")
    return traces, real


def within_band(ratio: float, replay: bool) -> bool:
    """predicted / real within the target: REPLAY_BAND for a trace simulated at its own rate, else WHATIF_BAND."""
    return abs(ratio - 1) <= (REPLAY_BAND if replay else WHATIF_BAND)


def bands_count(replays: list, whatifs: list) -> str:
    """'N of M': how many of the replay and what-if ratios are within their bands."""
    inside = sum(within_band(r, True) for r in replays) + sum(within_band(r, False) for r in whatifs)
    return f"{inside} of {len(replays) + len(whatifs)}"


@dataclass(frozen=True)
class Progress:
    """How many of the planned traced and untraced runs have finished."""

    traced: int
    traced_planned: int
    untraced: int
    untraced_planned: int

    @property
    def complete(self) -> bool:
        return self.traced == self.traced_planned and self.untraced == self.untraced_planned

    def describe(self) -> str:
        return (f"{self.traced} of {self.traced_planned} traced and {self.untraced} of {self.untraced_planned} "
                "untraced runs")


def write_results(folder: Path, setup: ModelSetup, trace_rate: Rate, rates: list, traces: list, real: dict,
                  sim_bits: dict, latency_ns: float, progress: Progress | None = None) -> Path | None:
    """The measurements a kept folder's traces are judged by, for bench/whatif_repredict.py: each rate's real step
    and the bits/s it is simulated at, and each trace's folder and same-process steps. Written after every run, so a
    benchmark cut short keeps what its finished runs measured ("partial": the runs done of those planned); None,
    and nothing written, until a trace and a real step at every rate exist."""
    if not traces or any(real[r.label].step_ms is None for r in rates):
        return None
    results = {
        "model": setup.key, "trace_rate": trace_rate.label, "latency_ns": latency_ns,
        "rates": [{"label": r.label, "bits_per_s": sim_bits[r.label], "tbf_bits_per_s": r.bits_per_s,
                   "real_ms": real[r.label].step_ms, "real_cpu_ms": real[r.label].cpu_ms} for r in rates],
        "traces": [{"index": t.index + 1, "folder": str(t.folder.relative_to(folder)),
                    "before_window_ms": t.before_window_ms, "before_window_cpu_ms": t.before_window_cpu_ms,
                    "same_run_ms": {label: entry.step_ms for label, entry in t.after_window.items()}}
                   for t in traces],
    }
    if progress and not progress.complete:
        results["partial"] = asdict(progress)
    path = folder / RESULTS_FILE
    write_text_atomic(path, json.dumps(results, indent=2) + "\n")
    return path


def label_slug(label: str) -> str:
    """A rate's label as part of a file name: "100 Mbit/s" -> "100Mbits"."""
    return label.replace(" ", "").replace("/", "")


def convert(folder: Path, env: dict) -> None:
    """convert_to_et.py on a traced run's folder; BenchError when it fails."""
    done = run_child([sys.executable, REPO_ROOT / "convert_to_et.py", folder, "--no-progress"], env=env,
                     timeout_s=3600)
    if not done.ok:
        raise BenchError(f"convert_to_et.py {folder} failed: {done.reason()}")


def simulate_at(sim: Simulator, folder: Path, label: str, bits_per_s: float, latency_ns: float):
    """ASTRA-sim on a converted run at a payload rate through the loopback (half of it per link of a 2-NPU ring)."""
    return sim.module.simulate_run(folder, bandwidth_gbs=link_gbs(bits_per_s), latency_ns=latency_ns,
                                   binary=sim.binary, work_dir=folder / f"astra-sim-{label_slug(label)}")


def predict(sim: Simulator, traces: list, rates: list, sim_bits: dict, latency_ns: float) -> None:
    for trace in traces:
        for rate in rates:
            trace.predictions[rate.label] = simulate_at(sim, trace.folder, rate.label, sim_bits[rate.label],
                                                        latency_ns)


# -------------------------------------------------------------------------------------------------- report
_STARTED = time.perf_counter()


def phase(what: str) -> None:
    print(f"... {what} (at {time.perf_counter() - _STARTED:.0f} s, load {load1():.1f})", flush=True)


def fmt_ms(value: float | None) -> str:
    return f"{value:,.1f}" if value else "n/a"


def ratio_range(ratios: list) -> str:
    if not ratios:
        return "n/a"
    low, high = min(ratios), max(ratios)
    return f"{low:.2f}x" if low == high else f"{low:.2f}x to {high:.2f}x"


def against_untraced_line(replays: list, whatifs: list) -> str:
    """The report's verdict against the untraced runs (overview() reads it back: PART_AGAINST_UNTRACED)."""
    return (f"Replay check (target within {REPLAY_BAND:.0%}): predicted / real {ratio_range(replays)}. What-if at the "
            f"other rates (target within {WHATIF_BAND:.0%}): {ratio_range(whatifs)}. {bands_count(replays, whatifs)} "
            "within the bands.")


def against_same_process_line(replays: list, whatifs: list) -> str:
    """The report's verdict against the traced processes' own steps after their windows (PART_AGAINST_SAME)."""
    return (f"Against each traced run's own untraced steps after its window (the same process): replay "
            f"{ratio_range(replays)}, what-if at the other rates {ratio_range(whatifs)}; "
            f"{bands_count(replays, whatifs)} within the bands.")


def faster_than(rate: Rate, traced: Rate) -> bool:
    """A network faster than the traced one (the unthrottled loopback is faster than any tbf rate)."""
    if not rate.throttled:
        return traced.throttled
    return traced.throttled and rate.bits_per_s > traced.bits_per_s


def bound_line(traces: list, real: dict) -> str | None:
    """bound_verdict over every trace's predictions at the rates faster than its own."""
    return bound_verdict([(result.without_communication_cpu_ms, result.step_ms, real[label].step_ms)
                          for trace in traces for label, result in trace.predictions.items()
                          if getattr(result, "without_communication_cpu_ms", None)
                          and faster_than(real[label].rate, trace.rate)])


def bound_verdict(points: list) -> str | None:
    """On the networks faster than a trace's own, from (step simulated without the communication threads' CPU time
    (trace_tools.simulate.without_communication_cpu), predicted step, real step) per point: the first over the real
    step, and how often the real step lies between the two (within the other rates' band); None without points."""
    if not points:
        return None
    lows = [bound / real for bound, _, real in points]
    inside = sum(bound <= real * (1 + WHATIF_BAND) and real <= predicted * (1 + WHATIF_BAND)
                 for bound, predicted, real in points)
    return (f"On the networks faster than the traced one, the communication threads' CPU time in the `.et` (measured "
            f"at the traced rate, where gloo spends more per byte) bounds the step from above; simulated without it, "
            f"{ratio_range(lows)} of the real step. The real step lies between the two (within {WHATIF_BAND:.0%}) in "
            f"{inside} of {len(points)}.")


def loads_text(loads: list) -> str:
    return ", ".join(f"{a:.1f}->{b:.1f}" for a, b in loads)


def report(setup: ModelSetup, args, sim: Simulator, verification: list, micro: list, traces: list, real: dict,
           unthrottled_bits: float, unthrottled_source: str, ns: Namespace, invocation: str) -> str:
    """The Markdown of one run of the benchmark: what ran, where, and the tables."""
    heading = setup.label if not traces[0].rate.throttled else f"{setup.label}, traced at {traces[0].rate.label}"
    lines = [f"### {heading}", "",
             f"Measured {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}, as root, with "
             f"`{invocation}`.", "",
             f"- {machine_description(('torch', 'transformers', 'mlc-chakra'))}; Linux {platform.release()}",
             f"- code: {source_revision()} (the tracer, the converter and this benchmark)",
             f"- model: `{setup.program}`"
             + (f", {traces[0].parameters:,} parameters" if traces and traces[0].parameters else "")
             + f", {setup.batch} per rank"
             + (f", {setup.accumulation} micro-batches a step (`--gradient-accumulation-steps {setup.accumulation}`)"
                if setup.accumulation > 1 else "")
             + (", under `torch.compile` (`--compile`: TorchInductor's CPU code)" if setup.compiled else "")
             + f", {RANKS} ranks (torchrun, gloo, CPU, "
               f"OMP_NUM_THREADS=1), fp32, `nice -n {NICE}`",
             f"- network: a private namespace's `lo`, MTU {ns.mtu}, {ns.offload_note}; rates as `tc qdisc replace dev lo "
             f"root tbf rate R burst B latency {QUEUE_LATENCY}` with B = one packet + R x {ns.burst_slack_s * 1e6:g} us",
             "- ASTRA-sim: " + (f"`{sim.binary}` (analytical, congestion-unaware), 2-NPU Ring, ring all-reduce, "
                                 f"latency {args.sim_latency_ns:g} ns, per-link bandwidth P/2 (P: the payload rate "
                                 "at R, below)" if sim.ok else f"predictions skipped: {sim.missing}"),
             f"- unthrottled R = {format_bits(unthrottled_bits)} ({unthrottled_source})",
             "- order of the runs: " + ", ".join(f"{kind} {number + 1}" for kind, number in
                                                  run_order(args.traces, args.repeats)),
             "  (each kind spread over the benchmark's time, so the machine's speed drifting weighs on both alike)",
             ""]
    lines += ["tbf check: one TCP stream's payload rate P through `lo` (expected share of R for full packets: "
              f"{expected_goodput_share(ns.mtu):.3f}); the simulator's links move payload only, so rate R is "
              "simulated at P.", "",
              format_table(["rate R", "burst B bytes", "B/R ms", "payload Mbit/s", "payload / R",
                            "payload / expected", "drops"], verification), ""]
    lines += ["All-reduce micro-benchmark: 2-rank gloo all-reduce (median of the repeats) against the ring's 2S/R "
              "and ASTRA-sim on a 2-rank `.et` of one ALL_REDUCE at P/2 per link.", "",
              format_table(["rate", "MB", "repeats", "real ms", "ring 2S/R ms", "real / ring", "ASTRA-sim ms",
                            "ASTRA-sim / real"], micro), ""]
    real_rows = [[label, len(r.steps), fmt_ms(r.step_ms), fmt_ms(r.cpu_ms), fmt_ms(r.median_ms), r.spread(),
                  ", ".join(f"{ms:,.0f}" for ms in r.segment_ms), ", ".join(f"{load:.1f}" for load in r.loads), r.drops]
                 for label, r in real.items()]
    drifting = max(real.values(), key=lambda r: r.drift)
    lines += [f"Untraced real runs: {args.repeats} run(s) of {args.skip} + ({args.warmup_cycles} + {args.cycles}) x "
              f"{len(real)} x {args.block} steps; the rate changes every {args.block} steps, in alternating order each "
              f"cycle, so load drift weighs on every rate alike; the first {args.skip} steps, the first "
              f"{args.warmup_cycles} cycle(s), steps that straddle a change and the first {args.settle} after it are "
              "left out. Step = the trainer's `ms/step` log line (`--logging-steps 1 --loss-sync-steps "
              f"{LOSS_SYNC_STEPS}`: the loss is read and all-reduced every {LOSS_SYNC_STEPS}th step, not every step); "
              "the real step is the mean of the block medians, which cancels a steady drift of the load. CPU = the "
              "`cpu` ms/step of the same lines (rank 0's process, all threads), averaged the same way.",
              "", format_table(["network", "steps", "real step ms", "CPU ms/step", "pooled median ms", "p10-p90 ms",
                                "block medians ms", "load 1-min at each block", "drops"], real_rows), ""]
    stalls = [(label, held) for label, r in real.items() for held in r.stalls] + \
        [(label, held) for t in traces for label, r in t.after_window.items() for held in r.stalls]
    if stalls:
        lines += [f"**lo's tbf stalled {len(stalls)} time(s)** (it held packets and sent none for a second) and was "
                  "replaced by a new qdisc of the same rate; the step during which it was replaced is left out: "
                  + "; ".join(f"at {label}: {held}" for label, held in stalls) + ".", ""]
    if drifting.drift > DRIFT_WARNING:
        lines += [f"**The step changed during the run at a fixed rate:** the block medians at {drifting.rate.label} "
                  f"are {100 * drifting.drift:.0f}% apart (other jobs' load, or the ranks' own variation on a machine "
                  "with as many cores as ranks). Read the ratios below with that uncertainty; more cycles or a "
                  "quieter machine narrow it.", ""]
    trace_rows = [[t.index + 1, t.rate.label, fmt_ms(t.traced_ms), fmt_ms(t.untraced_ms), fmt_ms(t.before_window_ms),
                   fmt_ms(t.before_window_cpu_ms), loads_text([t.load])] for t in traces]
    lines += ["Traced runs (converted with `convert_to_et.py`):", "",
              format_table(["trace", "trace rate", "traced step ms (run.json)", "untraced step ms (run.json)",
                            "log: steps before the window ms", "log: CPU ms/step before the window",
                            "load before->after"], trace_rows), ""]
    after_window = any(t.after_window for t in traces)
    if after_window:
        rows = [[t.index + 1] + [f"{fmt_ms(t.after_window[r].step_ms)} / cpu {fmt_ms(t.after_window[r].cpu_ms)} "
                                 f"({len(t.after_window[r].steps)})" for r in real] for t in traces]
        lines += [f"The traced runs' own untraced steps after their window: each run went on through every rate "
                  f"({args.after_window_cycles} cycle(s) of {args.block} steps a rate, as the untraced run, the steps "
                  "straddling a change and the first ones after it left out), so each prediction can also be set "
                  "against the process it was traced in. Mean of the block medians, ms: step / CPU time of rank 0's "
                  "process (steps):", "",
                  format_table(["trace"] + list(real), rows), ""]
    if sim.ok:
        rows, replay, whatif, same_replay, same_whatif, compute = [], [], [], [], [], []
        for trace in traces:
            own_real, own_predicted = real[trace.rate.label].step_ms, trace.predictions[trace.rate.label].step_ms
            for label, result in trace.predictions.items():
                measured = real[label].step_ms
                ratio = result.step_ms / measured
                (replay if label == trace.rate.label else whatif).append(ratio)
                note = "replay (trace simulated at its own rate)" if label == trace.rate.label else ""
                per_rank = " / ".join(f"{ms:,.1f}" for ms in result.per_rank_ms)
                cpu_ratio = real[label].cpu_ms / trace.before_window_cpu_ms \
                    if real[label].cpu_ms and trace.before_window_cpu_ms else None
                if cpu_ratio:
                    compute.append(cpu_ratio)
                row = [setup.label, f"{trace.index + 1} @ {trace.rate.label}", label, fmt_ms(measured),
                       fmt_ms(result.step_ms), f"{ratio:.2f}x", f"{cpu_ratio:.2f}x" if cpu_ratio else "n/a",
                       f"{measured - own_real:+,.1f}",
                       f"{result.step_ms - own_predicted:+,.1f}", per_rank]
                if after_window:
                    same_ms = trace.after_window[label].step_ms if label in trace.after_window else None
                    if same_ms:
                        (same_replay if label == trace.rate.label else same_whatif).append(result.step_ms / same_ms)
                    row += [fmt_ms(same_ms), f"{result.step_ms / same_ms:.2f}x" if same_ms else "n/a"]
                rows.append(row + [note])
        same_columns = ["same run ms", "predicted / same run"] if after_window else []
        lines += ["Predictions: ASTRA-sim on each trace's `.et` at P/2 per link (the slower rank's finish) against "
                  "the real untraced step at R. The two change columns are the step's change from the trace's own "
                  "rate, real and predicted: what the network alone adds, apart from how well the `.et` replays its "
                  "own step. CPU real / trace: the real run's CPU time per step at that rate over the traced run's "
                  "before its window (rank 0's process; the `.et`'s compute is the latter's): below 1, the same work "
                  "took less CPU in the real run." + (" The same-run columns set the prediction against the traced "
                                                     "run's own untraced steps after its window." if after_window
                                                     else ""), "",
                  format_table(["model", "trace", "network rate", "real step ms", "predicted ms", "predicted / real",
                                "CPU real / trace", "real change ms", "predicted change ms", "per rank ms",
                                *same_columns, "note"], rows),
                  "",
                  against_untraced_line(replay, whatif), ""]
        bounded = bound_line(traces, real)
        if bounded:
            lines += [bounded, ""]
        if compute:
            lines += [f"Compute: the real runs spent {ratio_range(compute)} the traced runs' CPU time per step (before "
                      "their windows) on the same work. The `.et`'s compute is the traced runs', so that difference is "
                      "the machine's (its speed at another time, or at another rate), not the conversion's.", ""]
        if same_replay or same_whatif:
            lines += [against_same_process_line(same_replay, same_whatif), ""]
        # The same replay against the traced run's own untraced steps: the same process on the same machine
        # minutes earlier, so what the two runs' machines differed by (next line) is out of it. On a CPU run the
        # converter's recording cost comes from CPU time, not from these wall-clock steps, so this is no tautology.
        same_run = [t.predictions[t.rate.label].step_ms / t.before_window_ms for t in traces
                    if t.before_window_ms and t.rate.label in t.predictions]
        if same_run:
            lines += [f"Replay against each traced run's own untraced steps (the trainer's log, before the window): "
                      f"predicted / real {ratio_range(same_run)}.", ""]
        # And against the untraced steps the tracer timed in the traced process, before and after the window: the
        # steps whose CPU time the `.et`'s ops take. A process's pace drifts (14-21% between the steps before and after
        # one window on the device machine's CPU), so this one sets the graph and the network apart from that drift.
        tracer_run = [t.predictions[t.rate.label].step_ms / t.untraced_ms for t in traces
                      if t.untraced_ms and t.rate.label in t.predictions]
        if tracer_run:
            lines += [f"Replay against the untraced steps the tracer timed in each traced process (run.json, before "
                      f"and after the window; the slower rank's, as the converter reads them): predicted / real "
                      f"{ratio_range(tracer_run)}.", ""]
    else:
        lines += [f"Predictions skipped: {sim.missing}.", ""]
    # The trace and the real runs ran at different times: on a shared machine its speed may have changed between.
    pace = [t.before_window_ms / real[t.rate.label].step_ms for t in traces if t.before_window_ms]
    if pace:
        lines += [f"Machine between the runs: the traced runs' own untraced steps (before the window) took "
                  f"{ratio_range(pace)} the untraced run's step at the same rate"
                  + (f"; more than {100 * DRIFT_WARNING:.0f}% apart, so part of every ratio above is the machine's "
                     "changing speed, not the `.et`." if max(abs(r - 1) for r in pace) > DRIFT_WARNING else "."), ""]
    pace_after = [t.after_window[label].step_ms / entry.step_ms for t in traces for label, entry in real.items()
                  if label in t.after_window and t.after_window[label].step_ms]
    if pace_after:
        lines += [f"After their windows, the traced runs' untraced steps took {ratio_range(pace_after)} the untraced "
                  "run's step at each rate.", ""]
    return "\n".join(lines)


def write_docs(path: Path, key: str, section: str) -> None:
    """Put this model's part into the whatif block of docs/BENCHMARKS.md: the block's introduction and this part
    are rewritten, the other models' parts and everything outside the block are kept (the block is appended when
    the file has none)."""
    text = path.read_text(encoding="utf-8") if path.is_file() else "# Benchmarks\n"
    if DOCS_BEGIN in text and DOCS_END in text:
        head, rest = text.split(DOCS_BEGIN, 1)
        block, tail = rest.split(DOCS_END, 1)
    else:
        head, block, tail = text.rstrip("\n") + "\n\n", "", "\n"
    parts = {match.group(1): match.group(0) for match in MODEL_PART.finditer(block)}
    parts[key] = f"{MODEL_BEGIN.format(key=key)}\n{section.strip()}\n{MODEL_END.format(key=key)}"
    ordered = [parts.pop(k) for k in MODELS if k in parts] + [parts[k] for k in sorted(parts)]
    block = "\n" + DOCS_INTRO.strip() + "\n\n" + overview(ordered) + "\n\n" + "\n\n".join(ordered) + "\n"
    write_text_atomic(path, head + DOCS_BEGIN + block + DOCS_END + tail)


DOCS_WIDTH = 118  # the prose lines of docs/BENCHMARKS.md
# The lines of a part that overview() reads back: report() writes them
PART_HEADING = re.compile(r"^### (.+)$", re.MULTILINE)
PART_MEASURED = re.compile(r"^Measured (\d{4}-\d\d-\d\d)", re.MULTILINE)
PART_CODE = re.compile(r"^- code: (.+?) \(the tracer", re.MULTILINE)
PART_AGAINST_UNTRACED = re.compile(rf"^Replay check \(target within {REPLAY_BAND:.0%}\): predicted / real (.+?)\. "
                                   rf"What-if at the other rates \(target within {WHATIF_BAND:.0%}\): (.+?)\. "
                                   r"(\d+) of (\d+) within the bands\.$", re.MULTILINE)
PART_AGAINST_SAME = re.compile(r"^Against each traced run's own untraced steps after its window \(the same process\): "
                               r"replay .+?, what-if at the other rates .+?; (\d+) of (\d+) within the bands\.$",
                               re.MULTILINE)


def overview(parts: list[str]) -> str:
    """A table of the parts' results, one row each, read from the lines report() wrote in them, and the points
    within the bands over all parts: against the untraced runs and against the traced processes' own steps."""
    rows = []
    inside, points, inside_same, points_same = 0, 0, 0, 0
    for part in parts:
        heading, measured = PART_HEADING.search(part), PART_MEASURED.search(part)
        untraced, same = PART_AGAINST_UNTRACED.search(part), PART_AGAINST_SAME.search(part)
        if not (heading and untraced):
            continue  # not a part report() wrote
        inside, points = inside + int(untraced.group(3)), points + int(untraced.group(4))
        if same:
            inside_same, points_same = inside_same + int(same.group(1)), points_same + int(same.group(2))
        code = PART_CODE.search(part)
        rows.append([heading.group(1), measured.group(1) if measured else "-", code.group(1) if code else "-",
                     untraced.group(1), untraced.group(2),
                     f"{untraced.group(3)} of {untraced.group(4)}",
                     f"{same.group(1)} of {same.group(2)}" if same else "-"])
    if not rows:
        return "No run has been written here yet."
    rows.append(["all runs", "", "", "", "", f"{inside} of {points}", f"{inside_same} of {points_same}"])
    summary = ("Every run below at a glance, as each measured it with the code of its day (the commit where the part "
               f"names it; §4b says what changed since): the replays (target within {REPLAY_BAND:.0%}) and the other "
               f"rates (within {WHATIF_BAND:.0%}) against the untraced runs, and the points within those bands "
               "against the untraced runs and against each traced process's own untraced steps after its window. "
               "This table is made anew from the parts' own lines whenever a run rewrites its part.")
    return (textwrap.fill(summary, width=DOCS_WIDTH) + "\n\n"
            + format_table(["run", "measured", "code", "replays / real", "other rates / real", "within the bands",
                            "within the bands, same process"], rows))


DOCS_INTRO = """
## 4. What-if fidelity: ASTRA-sim on our `.et` against real runs on slower networks

`bench/whatif_bench.py` (as root: it makes a network namespace and rate-limits its loopback with `tc tbf`) runs
2-rank gloo training at several network rates, traces a run, converts it with `convert_to_et.py`, simulates the `.et`
in ASTRA-sim at every rate and compares with the real untraced step. The loopback's qdisc is one medium for both
directions: a 2-rank ring all-reduce of S bytes moves 2S through it, so rate R is simulated as a 2-NPU ring with P/2
per link, where P is the payload rate a TCP stream gets through tbf at R (R less the packets' headers and the
acknowledgements' share of the qdisc: the simulator's links carry payload only); the all-reduce micro-benchmark checks
that equivalence. The real steps come from one run that changes the rate every few steps in alternating order, so a
shared machine's changing load weighs on every rate alike (one run per rate did not: the load fell from 12 to 6
between them and the unthrottled step came out slower than the 2 Gbit/s one), and the traced and untraced runs
alternate, so the machine's speed drifting over minutes weighs on both alike. Each traced run also goes on untraced
through every rate once its window has closed (`--after-window-cycles`): two processes of the same run on this 2-core
machine can differ by a tenth in speed minutes apart, so each prediction is set both against the untraced run and
against the process it was traced in ("same run"). Each part below is rewritten by a run of its `--model`.
"""


# ---------------------------------------------------------------------------------------------------- main
def _per_model(name: str) -> str:
    return "(default per model: " + ", ".join(f"{k} {getattr(m, name)}" for k, m in MODELS.items()) + ")"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="bench/whatif_bench.py", description=__doc__ + " Runs as root (ip netns, tc): checks tbf's rates, "
        "compares a gloo all-reduce with the ring's time and ASTRA-sim's, traces and converts a run at one rate, runs "
        "untraced at every rate and prints predicted/real per rate. Exits 1 when something could not be measured.")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny", help="configuration (default: %(default)s)")
    parser.add_argument("--rates", default=None,
                        help="comma-separated tc rates of the real runs, e.g. unthrottled,1gbit,100mbit "
                             "(default per model: " + "; ".join(f"{k}: {','.join(m.rates)}" for k, m in MODELS.items())
                             + ")")
    parser.add_argument("--trace-rate", default="unthrottled", help="rate of the traced run(s) (default: %(default)s)")
    parser.add_argument("--traces", type=int, default=1, help="separate traced runs (default: %(default)s)")
    parser.add_argument("--trace-wait-steps", type=int, default=None,
                        help="untraced steps before the trace window (default: the model's skipped steps + 2)")
    parser.add_argument("--trace-active-steps", type=int, default=None,
                        help="traced steps (default: the trainer's own default)")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1, metavar="N",
                        help="micro-batches an optimizer step, in the traced and the untraced runs alike: DDP reduces "
                             "the gradients of the last one only, so N-1 forward and backward passes a step run "
                             "without communication (default: %(default)s)")
    parser.add_argument("--compile", action="store_true",
                        help="the model under torch.compile in the traced and the untraced runs alike (the trainer's "
                             "--compile; the launchers trace eager): the trace records the compiled graphs' calls, "
                             "not the eager operators")
    parser.add_argument("--skip", type=int, default=None, help="first steps of a run left out " + _per_model("skip"))
    parser.add_argument("--block", type=int, default=None,
                        help="steps at one rate before the untraced run changes it " + _per_model("block"))
    parser.add_argument("--settle", type=int, default=None,
                        help="steps left out after each change of rate " + _per_model("settle"))
    parser.add_argument("--cycles", type=int, default=None,
                        help="passes over all rates in an untraced run; an even number cancels a steady drift of "
                             "the machine's load " + _per_model("cycles"))
    parser.add_argument("--warmup-cycles", type=int, default=None,
                        help="passes over all rates before those, thrown away " + _per_model("warmup_cycles"))
    parser.add_argument("--repeats", type=int, default=None, help="untraced runs, pooled " + _per_model("repeats"))
    parser.add_argument("--after-window-cycles", type=int, default=None,
                        help="passes over all rates in each traced run once its window has closed: the same "
                             "process's untraced steps, which the predictions are also set against (0: none) "
                             + _per_model("after_window_cycles"))
    parser.add_argument("--micro-rate", default="1gbit",
                        help="rate of the all-reduce micro-benchmark (default: %(default)s)")
    parser.add_argument("--micro-sizes", default=",".join(str(s) for s in MICRO_SIZES),
                        help="all-reduce sizes in bytes (default: %(default)s)")
    parser.add_argument("--micro-repeats", type=int, default=3, help="timed all-reduces per size (default: %(default)s)")
    parser.add_argument("--check-seconds", type=float, default=1.0,
                        help="seconds of sending per rate in the tbf check (default: %(default)s)")
    parser.add_argument("--mtu", type=int, default=DEFAULT_MTU, help="lo's MTU in the namespace (default: %(default)s)")
    parser.add_argument("--burst-slack-us", type=float, default=None,
                        help="tbf burst beyond one packet, in microseconds at the rate (default per model: "
                             + ", ".join(f"{k} {m.burst_slack_s * 1e6:g}" for k, m in MODELS.items()) + ")")
    parser.add_argument("--sim-latency-ns", type=float, default=500.0,
                        help="ASTRA-sim link latency (default: %(default)s)")
    parser.add_argument("--astra-sim", default=None, metavar="PATH",
                        help="ASTRA-sim's analytical binary (default: $ASTRA_SIM); without it the predictions are "
                             "skipped and said so")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tiny model, unthrottled and 100mbit, few steps, one 10 MB all-reduce")
    parser.add_argument("--docs", default=None,
                        help="file whose whatif block gets the tables (default: docs/BENCHMARKS.md)")
    parser.add_argument("--no-docs", action="store_true", help="print only (--quick never writes the docs)")
    parser.add_argument("--keep", metavar="DIR", default=None,
                        help=f"keep the runs' logs, traces and .et files in DIR, with {RESULTS_FILE} (the real steps) "
                             "for bench/whatif_repredict.py, rewritten after every run: a benchmark stopped early "
                             "keeps what its finished runs measured")
    return parser


def resolve(args) -> tuple:
    """The model setup and the parsed rates, after the per-model defaults (main has put in --quick's settings)."""
    setup = MODELS[args.model]
    for name in ("skip", "block", "settle", "cycles", "warmup_cycles", "after_window_cycles", "repeats"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(setup, name))
    if args.trace_wait_steps is None:
        args.trace_wait_steps = 4 if args.quick else setup.skip + 2
    if min(args.skip, args.settle, args.warmup_cycles, args.after_window_cycles) < 0 or args.settle + 1 >= args.block:
        raise ValueError(f"--settle {args.settle} must leave steps in a --block of {args.block} (a step straddling "
                         "each change is left out too); --skip, --warmup-cycles and --after-window-cycles must be 0 "
                         "or more")
    for name in ("cycles", "after_window_cycles"):
        if getattr(args, name) > 1 and getattr(args, name) % 2:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: use an even number (or 1), so every "
                             "rate sits as early as late in the run on average")
    if min(args.traces, args.repeats, args.cycles, args.micro_repeats, args.trace_wait_steps) < 1:
        raise ValueError("--traces, --repeats, --cycles, --micro-repeats and --trace-wait-steps must be at least 1")
    rates = [parse_rate(text) for text in (args.rates or ",".join(setup.rates)).split(",") if text.strip()]
    trace_rate = parse_rate(args.trace_rate)
    if trace_rate.label not in [r.label for r in rates]:
        rates.append(trace_rate)  # the replay check needs real runs at the trace's own rate
    if len(rates) < 2:
        raise ValueError("--rates needs at least two rates")
    micro_rate = parse_rate(args.micro_rate)
    if not micro_rate.throttled:
        raise ValueError("--micro-rate must be a throttled rate (the unthrottled one is always measured)")
    sizes = tuple(int(s) for s in args.micro_sizes.split(",") if s.strip())
    if setup.script and (args.gradient_accumulation_steps > 1 or args.compile):
        raise ValueError(f"--model {args.model} runs {setup.script}, which has no --gradient-accumulation-steps or "
                         "--compile: those are the trainer's")
    if args.gradient_accumulation_steps < 1:
        raise ValueError(f"--gradient-accumulation-steps {args.gradient_accumulation_steps}: at least 1")
    if args.gradient_accumulation_steps > 1:
        # Another configuration: its own trace names, docs part and heading, beside the model's one-batch runs
        n = args.gradient_accumulation_steps
        setup = replace(setup, key=f"{setup.key}-accumulate{n}", label=f"{setup.label}, {n} micro-batches a step",
                        accumulation=n)
    if args.compile:
        setup = replace(setup, key=f"{setup.key}-compiled", label=f"{setup.label}, compiled", compiled=True)
    return setup, rates, trace_rate, micro_rate, sizes


def kept_note(root: Path, keep: str | None) -> str:
    """For a benchmark that stopped early with --keep: where what its finished runs measured is, to be judged."""
    if not keep:
        return ""
    path = root / RESULTS_FILE
    if not path.is_file():
        return f"; no trace with a real step at every rate had been measured, so {path} was not written"
    partial = json.loads(path.read_text(encoding="utf-8")).get("partial")
    runs = Progress(**partial).describe() if partial else "every run"
    return f"; what {runs} measured is in {path}: judge it with `python bench/whatif_repredict.py {root}`"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        quick_settings(parser, argv, args, QUICK_SETTINGS)
    foreign = foreign_checkout(__file__)
    if foreign:
        return fail(foreign)
    exit_on_sigterm()
    try:
        setup, rates, trace_rate, micro_rate, sizes = resolve(args)
    except ValueError as exc:
        return fail(f"bench/whatif_bench.py: {exc}")
    problem = missing_requirement()
    if problem:
        return fail(f"bench/whatif_bench.py: {problem}")
    invocation = "python bench/whatif_bench.py " + shlex.join(argv) if argv else "python bench/whatif_bench.py"
    sim = find_simulator(args.astra_sim)
    if not sim.ok and not (args.quick or args.no_docs):
        # the model's part of docs/BENCHMARKS.md would be replaced by one without predictions, with exit 0
        return fail(f"ASTRA-sim is needed for the predictions the docs' part holds ({sim.missing}); build it with "
                    "./install_astra_sim.sh, or pass --no-docs to measure the real runs alone")
    env = child_env(threads=1)
    print(machine_description(("torch", "transformers", "mlc-chakra")))
    print(f"{setup.label}: rates {', '.join(r.label for r in rates)}; trace at {trace_rate.label} x {args.traces}; "
          f"untraced: {args.repeats} run(s) changing the rate every {args.block} steps, {args.cycles} cycle(s)")
    print("ASTRA-sim: " + (str(sim.binary) if sim.ok else f"predictions skipped: {sim.missing}"), flush=True)
    work = WorkFolder(args.keep, "whatif_bench-")
    root = work.path
    if args.keep:  # a results file left by an earlier run in this folder would stand for this run's
        (root / RESULTS_FILE).unlink(missing_ok=True)
    with work:
        try:
            slack = args.burst_slack_us * 1e-6 if args.burst_slack_us is not None else setup.burst_slack_s
            with Namespace(args.mtu, slack) as ns:
                print(f"namespace {ns.name}: lo MTU {ns.mtu}, {ns.offload_note}", flush=True)
                phase("tbf check (payload rate of one TCP stream)")
                checked = sorted({r.label: r for r in rates + [micro_rate]}.values(),
                                 key=lambda r: -(r.bits_per_s or 1e30))
                verification, payload = verify_rates(ns, checked, args.check_seconds)
                phase(f"all-reduce micro-benchmark at {micro_rate.label}" + ("" if args.quick else " and unthrottled"))
                micro, allreduce_bits = micro_benchmark(ns, micro_rate, sizes, args.micro_repeats, env, sim,
                                                        root / "micro", args.sim_latency_ns, unthrottled=not args.quick,
                                                        payload_bits=payload[micro_rate.label])
                unthrottled_bits, source = ((allreduce_bits, "a gloo all-reduce's 2S/t, unthrottled") if allreduce_bits
                                            else (payload.get("unthrottled"), "one TCP stream's payload rate"))
                sim_bits = simulated_rates(rates, payload, unthrottled_bits)

                def keep_results(traces: list, real: dict, progress: Progress) -> None:
                    write_results(root, setup, trace_rate, rates, traces, real, sim_bits, args.sim_latency_ns, progress)

                traces, real = interleaved_runs(ns, setup, trace_rate, rates, args, env, root,
                                                keep_results if args.keep else None)
                if sim.ok:
                    phase("ASTRA-sim")
                    predict(sim, traces, rates, sim_bits, args.sim_latency_ns)
                text = report(setup, args, sim, verification, micro, traces, real, unthrottled_bits, source, ns,
                              invocation)
        except (BenchError, NetemUnavailable) as exc:
            return work.fail(str(exc) + kept_note(root, args.keep))
        except KeyboardInterrupt:
            print("error: bench/whatif_bench.py: interrupted; the runs were stopped and the namespace removed"
                  + kept_note(root, args.keep), file=sys.stderr)
            return 130
        except SystemExit as exc:
            if exc.code == 128 + signal.SIGTERM:  # exit_on_sigterm: a `timeout` or a job scheduler ended it
                print("error: bench/whatif_bench.py: stopped by SIGTERM; the runs were stopped and the namespace "
                      "removed" + kept_note(root, args.keep), file=sys.stderr)
            raise
        except Exception as exc:  # the simulator's errors (SimulationError) and a broken .et: one line, exit 1
            if type(exc).__name__ != "SimulationError":
                raise
            return work.fail(str(exc))
    print()
    print(text)
    if not (args.quick or args.no_docs):
        # One part per model and trace rate: a trace taken on a throttled network does not replace the other.
        key = setup.key if not trace_rate.throttled else f"{setup.key}@{trace_rate.label.replace(' ', '')}"
        write_docs(Path(args.docs) if args.docs else DOCS, key, text)
        print(f"\nwritten to {args.docs or DOCS} (whatif block, {key} part)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
