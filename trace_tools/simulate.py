"""Run ASTRA-sim's analytical backend on a converted run and compare its predicted step with the measured one."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from .atomic import (InterruptedAfterWriting, atomic_output, atomic_path, folder_held, process_is_alive, publication,
                     write_text_atomic)
from .command_line import ArgumentParser, StopSignal, die_with_parent, output_closed, path_argument
from .discover import read_run_info, subfolders
from .layout import (CONVERSION_SUMMARY, RUN_INFO, SIMULATION_FAILED_DIR, SIMULATION_FILE, SIMULATION_WORK_DIR, et_name,
                     et_sets)
from .step_timing import STEP_SPREAD_BOUND, step_times_of
from .summary import (ConvertedRun, converted_from, read_previous_results, reconvert_command, records_set,
                      run_info_files, unrecorded_et_file)
from .validate import (ASTRA_SIM_OTHER_FILES, CLOCK_LIMIT_NS, SerializedMessage, collectives_agree, group_members,
                       misnamed_rank, open_file_limit_problem, validate_et)
from .wake_cost import RankWake, TrainingThread, WakeAdjustment, training_thread

if TYPE_CHECKING:
    from .scale import SourceEt

ASTRA_SIM_ENV = "ASTRA_SIM"
INSTALLER = "install_astra_sim.sh"
BINARY_NAME = "AstraSim_Analytical_Congestion_Unaware"
WORK_DIR_NAME = SIMULATION_WORK_DIR  # inside the run folder: the configuration files, ASTRA-sim's output and logs
NETWORK_FILE, SYSTEM_FILE, MEMORY_FILE, COMM_GROUP_FILE = "network.yml", "system.json", "remote_memory.json", \
    "comm_groups.json"
OUTPUT_FILE = "astra-sim.out"
PROGRESS_EVERY_S = 60.0  # a line on a simulation still running (1024 NPUs had run 8 minutes without one)
LOG_DIR = "log"  # ASTRA-sim's --logging-folder in the work folder: it appends, so each run starts it anew
SCALED_DIR = "scaled_{ranks}"  # in the work folder: the set scaled from the traced one for --ranks N
WITHOUT_COMMUNICATION_CPU_DIR = "without_communication_cpu"  # in the work folder: the .et copies and their simulation
# In the work folder: the .et copies whose training thread has the simulated network's wake cost (trace_tools.wake_cost)
WAKE_COST_DIR = "wake_cost"
WAKE_SIMULATIONS = 4  # at most: the set as written, then with the cost of its pauses, until the pauses settle
WAKE_SETTLED = 0.01   # ... to a change within this share of the compute
# Beside the work folder: a simulation writes into .astra-sim.staging-<pid>-<random>/, renamed over the work folder
# only when it succeeds (so the work folder stays the one SIMULATION.md describes); one that failed in ASTRA-sim is
# kept as astra-sim.failed/ for its output.
STAGING_RE = re.compile(r"\.(?P<work>.+)\.staging-(?P<pid>\d+)-.*")
FAILED_SUFFIX = SIMULATION_FAILED_DIR[len(SIMULATION_WORK_DIR):]  # astra-sim.failed/

TOPOLOGIES = ("Ring", "FullyConnected", "Switch")  # the analytical backend's building blocks
COLLECTIVES = ("ring", "direct", "halvingDoubling", "doubleBinaryTree", "oneRing", "oneDirect", "oneHalvingDoubling")
# What ASTRA-sim implements besides all-reduce: halving-doubling has no all-to-all (it exits), the double binary tree
# is an all-reduce only. Those collective types fall back to these algorithms.
NOT_IMPLEMENTED = {"all-to-all": ({"halvingDoubling", "oneHalvingDoubling", "doubleBinaryTree"}, "direct"),
                   "all-gather": ({"doubleBinaryTree"}, "ring"), "reduce-scatter": ({"doubleBinaryTree"}, "ring")}
# Algorithms ASTRA-sim runs only on a power-of-two number of NPUs. Measured with astra-sim 518bd513ae11 on 3, 5 and 6
# NPUs: doubleBinaryTree segfaults, halvingDoubling and oneHalvingDoubling leave every rank unfinished ("unreleased
# nodes"); at 2, 4 and 8 they run. ring, direct, oneRing and oneDirect run at any count.
POWER_OF_TWO_ONLY = ("halvingDoubling", "oneHalvingDoubling", "doubleBinaryTree")
DEFAULT_LATENCY_NS = 500.0
# One collective in flight at a time, split into 4 chunks: the configuration whose 2-NPU ring matched a real gloo
# all-reduce within 1-6% (issue 9). "roofline-enabled": 0 replays every compute node for its traced duration.
SYSTEM_DEFAULTS = {
    "scheduling-policy": "LIFO",
    "endpoint-delay": 10,
    "active-chunks-per-dimension": 1,
    "preferred-dataset-splits": 4,
    "collective-optimization": "localBWAware",
    "local-mem-bw": 1600,
    "boost-mode": 0,
    "roofline-enabled": 0,
}
GIB = 1 << 30  # ASTRA-sim analytical's "GB" (NetworkFunction.cpp: bw * (1 << 30) / 1e9 bytes per ns)
# "sys[0] finished, 239530000 cycles, exposed communication 1000 cycles." (Workload::report); 1 cycle = 1 ns
FINISHED_RE = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles, exposed communication (\d+) cycles")
# A line ASTRA-sim logs (spdlog): "[2026-12-02 17:28:10.833] [workload] [info] ..." (spdlog's default pattern), or
# "[2026-01-01T00:00:00+0000] [I] <workload>: ..." (LoggerFactory's, in some versions): a time stamp, then a name or
# level in brackets
ASTRA_SIM_LOG_RE = re.compile(r"^\[[^\]]*\d\] \[[^\]]+\] ", re.MULTILINE)


class SimulationError(Exception):
    """A problem said in one line that names the flag or file; the command line prints it as `error: ...`. `usage`:
    whether it is the user's setting (exit 2) rather than the run's or ASTRA-sim's (exit 1); None: a message that starts
    with a flag or $ASTRA_SIM is one."""

    def __init__(self, message: str, usage: bool | None = None):
        super().__init__(message)
        self.usage = usage


ONE_NPU_PROBLEM = ("ASTRA-sim's analytical network needs at least 2 NPUs (a one-rank run has no communication: its "
                   "step is the critical path in CONVERSION_SUMMARY.md)")


# ---------------------------------------------------------------------------------------------------------------
# Network description
# ---------------------------------------------------------------------------------------------------------------
_BANDWIDTH_RE = re.compile(r"^\s*(?P<value>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)\s*(?P<prefix>[kKmMgGtT]i?)?"
                           r"(?P<unit>bits?|bytes?|b|B)?(?P<per>/s|ps)?\s*$")
_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40}


def parse_bandwidth(text: str) -> float:
    """A link bandwidth in ASTRA-sim's unit, GB/s with GB = 2**30 bytes.

    With a unit, prefixes are SI (k, M, G, T: powers of 10, as network rates are quoted: 100 Mbit/s, 12.5 GB/s)
    or binary (Ki, Mi, Gi: powers of 2); `bit`/`b` is bits, `B`/`byte` bytes, `/s` or `ps` optional. A plain
    number is already in ASTRA-sim's unit and is written to its network file as it is.
    """
    match = _BANDWIDTH_RE.match(text or "")
    if not match:
        raise SimulationError(f"--bandwidth {text!r}: not a rate (examples: 100Mbit/s, 2Gbit/s, 12.5GB/s, 800MB/s, "
                              "or a plain number in ASTRA-sim's GB/s of 2^30 bytes)")
    value = float(match.group("value"))
    prefix, unit = (match.group("prefix") or ""), match.group("unit")
    if unit is None:
        if prefix or match.group("per"):
            raise SimulationError(f"--bandwidth {text!r}: say bits or bytes ({value:g}{prefix}bit/s or "
                                  f"{value:g}{prefix}B/s)")
        gbs = value
    else:
        bits = unit.lower().startswith("bit") or unit == "b"
        bytes_per_s = value * _PREFIX[prefix.lower()] / (8 if bits else 1)
        gbs = bytes_per_s / GIB
    if not math.isfinite(gbs):
        raise SimulationError(f"--bandwidth {text!r}: too large to be a number")
    if gbs <= 0:
        raise SimulationError(f"--bandwidth {text!r}: must be more than 0")
    return gbs


def format_bandwidth(gbs: float) -> str:
    """A bandwidth in ASTRA-sim's GB/s, with the same rate in bit/s as networks are quoted."""
    bits = gbs * GIB * 8
    if not math.isfinite(bits):
        return f"{gbs:.6g} GB/s of 2^30 bytes"
    for unit, size in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= size:
            return f"{bits / size:.4g} {unit} ({gbs:.6g} GB/s of 2^30 bytes)"
    return f"{bits:.4g} bit/s ({gbs:.6g} GB/s of 2^30 bytes)"


def _canonical(value: str, choices: tuple[str, ...], flag: str) -> str:
    for choice in choices:
        if value.lower() == choice.lower():
            return choice
    raise SimulationError(f"{flag} {value}: not one of {', '.join(choices)}")


@dataclass
class Network:
    """One dimension of ASTRA-sim's analytical network, and the collective algorithm run on it."""

    npus: int
    bandwidth_gbs: float
    latency_ns: float = DEFAULT_LATENCY_NS
    topology: str = "Ring"
    collective: str = "ring"

    def __post_init__(self):
        self.topology = _canonical(self.topology, TOPOLOGIES, "--topology")
        self.collective = _canonical(self.collective, COLLECTIVES, "--collective")
        if self.npus < 2:
            raise SimulationError(f"--ranks {self.npus}: {ONE_NPU_PROBLEM}")
        if self.collective in POWER_OF_TWO_ONLY and self.npus & (self.npus - 1):
            raise SimulationError(f"--collective {self.collective}: needs a power-of-two number of NPUs (got "
                                  f"{self.npus}); ring and direct run at any count")
        if not (math.isfinite(self.bandwidth_gbs) and self.bandwidth_gbs > 0):
            raise SimulationError(f"--bandwidth {self.bandwidth_gbs}: must be more than 0")
        if not (math.isfinite(self.latency_ns) and self.latency_ns >= 0):
            raise SimulationError(f"--latency {self.latency_ns}: must be 0 or more (nanoseconds)")
        self.latency_ns = float(self.latency_ns) + 0.0  # -0 is 0 ns, and printed so

    def algorithms(self) -> dict[str, str]:
        """The algorithm of each collective type: the chosen one, or a fallback where ASTRA-sim has none."""
        chosen = {}
        for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
            unsupported, fallback = NOT_IMPLEMENTED.get(kind, (set(), ""))
            chosen[kind] = fallback if self.collective in unsupported else self.collective
        return chosen

    def describe(self) -> str:
        fallbacks = [f"{kind} {algo}" for kind, algo in self.algorithms().items() if algo != self.collective]
        collectives = f"{self.collective} collectives" + (f" ({', '.join(fallbacks)})" if fallbacks else "")
        return (f"{self.topology} of {self.npus} NPUs, {format_bandwidth(self.bandwidth_gbs)} per link, "
                f"{self.latency_ns:g} ns latency, {collectives}")

    def caveat(self) -> str:
        """What of the network this simulation does not model, where it changes the prediction ("" otherwise).
        `direct` sends each NPU's npus-1 messages at once; the congestion-unaware backend gives every message the
        link's full bandwidth, as if each NPU had npus-1 links: at 8 NPUs and 100 Mbit/s a 2-rank GPT-2 tiny step
        simulated at 40.4 ms with direct and 148.4 ms with ring (whose one message at a time per link a link does
        carry)."""
        if self.collective != "direct" or self.npus <= 2:
            return ""
        return (f"--collective direct: ASTRA-sim's congestion-unaware network sends each NPU's {self.npus - 1} "
                "messages at once, each at the link's full bandwidth, so the collectives come out up to "
                f"{self.npus - 1}x shorter than links of {format_bandwidth(self.bandwidth_gbs)} carry them; ring "
                "sends one message at a time on each link")


def network_yaml(network: Network) -> str:
    """The analytical backend's network file (NetworkParser: topology, npus_count, bandwidth in GB/s, latency ns)."""
    return (f"topology: [ {network.topology} ]\n"
            f"npus_count: [ {network.npus} ]\n"
            f"bandwidth: [ {network.bandwidth_gbs!r} ]  # GB/s, GB = 2^30 bytes\n"
            f"latency: [ {float(network.latency_ns)!r} ]  # ns\n")


def system_config(network: Network) -> dict:
    """ASTRA-sim's system file: scheduling, chunking and the collective algorithm of each collective type."""
    config = dict(SYSTEM_DEFAULTS)
    for kind, algorithm in network.algorithms().items():
        config[f"{kind}-implementation"] = [algorithm]
    return config


# ---------------------------------------------------------------------------------------------------------------
# Finding the binary and the workload
# ---------------------------------------------------------------------------------------------------------------
def find_astra_sim(path: str | os.PathLike | None = None) -> Path:
    """The ASTRA-sim binary: `path` (--astra-sim), else $ASTRA_SIM; a folder is searched for the binary."""
    origin = "--astra-sim"
    if path is None:
        path, origin = os.environ.get(ASTRA_SIM_ENV) or None, f"${ASTRA_SIM_ENV}"
    if path is None:
        raise SimulationError(f"ASTRA-sim not found: pass --astra-sim PATH or set ${ASTRA_SIM_ENV} to the "
                              f"{BINARY_NAME} binary (./{INSTALLER} builds it and prints the export line)")
    candidate = Path(path).expanduser()
    if candidate.is_dir():
        for inside in (candidate / "bin" / BINARY_NAME, candidate / BINARY_NAME,
                       candidate / "build/astra_analytical/build/bin" / BINARY_NAME):
            if inside.is_file():
                candidate = inside
                break
        else:
            raise SimulationError(f"{origin} {path}: a folder without bin/{BINARY_NAME} (./{INSTALLER} builds it)")
    if not candidate.is_file():
        raise SimulationError(f"{origin} {path}: no such file (./{INSTALLER} builds ASTRA-sim and prints the "
                              f"export {ASTRA_SIM_ENV}=... line)")
    if not os.access(candidate, os.X_OK):
        raise SimulationError(f"{origin} {path}: not executable")
    return candidate.resolve()


def find_workload(run: Path) -> tuple[Path, int]:
    """(workload prefix, ranks) of a converted run: a folder with <name>.<rank>.et files, or the prefix itself."""
    if not run.is_dir():
        ranks = et_sets(run.parent).get(run.name, {})
        if 0 in ranks:
            return run, _contiguous_ranks(run.parent, run.name, ranks)
        named = re.fullmatch(r"(?P<prefix>.+)\.\d+\.et", run.name)
        if run.is_file() and named and named["prefix"] in et_sets(run.parent):  # one rank's file of a set
            raise SimulationError(f"{run}: one rank's .et; give its folder ({run.parent}) or the set's prefix "
                                  f"({run.parent / named['prefix']})")
        raise SimulationError(f"{run}: no such folder (nor a workload prefix with {run.name}.0.et beside it)")
    every_set = et_sets(run)
    sets = {name: ranks for name, ranks in every_set.items() if 0 in ranks}
    if not sets and every_set:
        name, ranks = sorted(every_set.items())[0]
        present = ", ".join(map(str, sorted(ranks)))
        raise SimulationError(f"{run / et_name(name, 0)}: missing (the set has ranks {present}; every rank from 0 up "
                              "is needed)")
    if not sets:
        converted = {sub.name: max(len(r) for r in et_sets(sub).values()) for sub in subfolders(run)
                     if any(0 in r for r in et_sets(sub).values())}
        if converted:  # a folder of runs (outputs/): converting it again would not help
            names = sorted(converted)
            example = next((name for name in names if converted[name] > 1), names[0])  # one rank cannot be simulated
            raise SimulationError(f"{run}: no <name>.<rank>.et files in it, but in its folders "
                                  f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}: simulate one run at "
                                  f"a time, e.g. {run / example}")
        raise SimulationError(f"{run}: no <name>.<rank>.et files; convert the run first (python3 convert_to_et.py "
                              f"{run})")
    preferred = [run.resolve().name]
    from .discover import find_runs
    preferred += [found.name for found in find_runs([run]) if found.folder.resolve() == run.resolve()]
    name = next((n for n in preferred if n in sets), None)
    if name is None:
        if len(sets) > 1:
            raise SimulationError(f"{run}: several .et sets ({', '.join(sorted(sets))}); pass the one to simulate as "
                                  f"a prefix, e.g. {run / sorted(sets)[0]}")
        name = next(iter(sets))
    return run / name, _contiguous_ranks(run, name, sets[name])


def _contiguous_ranks(folder: Path, name: str, ranks: dict[int, Path]) -> int:
    """How many ranks the set has; a gap (rank 2 of 0-3 gone) is refused: ASTRA-sim would simulate ranks 0-1 as the
    whole run, a smaller world than the one traced."""
    count = 0
    while count in ranks:
        count += 1
    if count < len(ranks):
        raise SimulationError(f"{folder / et_name(name, count)}: missing (the set has ranks up to {max(ranks)}; "
                              "every rank from 0 up is needed)")
    return count


def process_groups(workload: Path, ranks: int) -> dict[str, list[int]]:
    """Communicator groups other than the world group, from each .et's `process_groups` metadata: pg_name -> ranks.

    ASTRA-sim takes pg_name "" or "0" as every rank and any other name as the integer id of a group that the
    --comm-group-configuration file must list; it cannot take a name that is not a number (torch's hashed names)."""
    groups: dict[str, list[int]] = {}
    for rank in range(ranks):
        path = workload.parent / et_name(workload.name, rank)
        metadata = et_metadata(path)
        world = _int_attr(metadata, "world_size")
        if world and world != ranks:  # ranks deleted from the top of the set, or a set of another run mixed in
            raise SimulationError(f"{path}: recorded in a world of {world} ranks, but the set has {ranks} .et files "
                                  f"({et_name(workload.name, 0)} to {et_name(workload.name, ranks - 1)}); simulate "
                                  "a complete set")
        for name, members in listed_groups(metadata, ranks).items():
            if name in ("", "0") or not name.isdigit():
                continue  # a name that is not a number cannot be listed; a collective in it stops ASTRA-sim
            if name in groups and groups[name] != members:
                raise SimulationError(f"{path}: process group {name} has ranks {members}, another rank's .et "
                                      f"says {groups[name]}")
            groups[name] = members
    return groups


def listed_groups(metadata, ranks: int) -> dict[str, list[int]]:
    """The process groups an .et's metadata lists (`process_groups`, as the converter writes it): name -> ranks
    (every rank when the group names none); empty when it lists none or the list does not parse."""
    return group_members(next((a.string_val for a in metadata.attr if a.name == "process_groups"), ""), ranks)


def _int_attr(metadata, name: str) -> int:
    return next((a.int64_val for a in metadata.attr if a.name == name), 0)


def traced_world_size(workload: Path) -> int:
    """The ranks the set was traced on: a scaled set's `traced_world_size` (scale_et.py), else 0."""
    return _int_attr(et_metadata(workload.parent / et_name(workload.name, 0)), "traced_world_size")


def et_metadata(path: Path):
    """The global metadata of a .et (its first message)."""
    from chakra.schema.protobuf.et_def_pb2 import GlobalMetadata
    from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd

    handle = openFileRd(str(path))
    try:
        metadata = GlobalMetadata()
        decodeMessage(handle, metadata)
    finally:
        handle.close()
    return metadata


# ---------------------------------------------------------------------------------------------------------------
# Running ASTRA-sim
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class SimulationResult:
    """ASTRA-sim's finish time of every rank; step_ms is the slowest rank's. Measurements are filled in by
    simulate_run when the run folder has them."""

    per_rank_ns: list[int]
    step_ms: float
    workload: Path
    network: Network
    command: list[str]
    work_dir: Path
    exposed_comm_ns: list[int] = field(default_factory=list)
    traced_ranks: int = 0
    measured_ms: dict[int, float] = field(default_factory=dict)
    measured_source: str = ""
    critical_path_ms: dict[int, float] = field(default_factory=dict)
    run_folder: Path | None = None  # where SIMULATION.md goes: the folder of the converted .et set
    # The slowest rank's step with the communication threads' CPU nodes at 0 µs (CPU runs; None: no such nodes, or
    # not simulated): see without_communication_cpu
    without_communication_cpu_ms: float | None = None
    simulation_file: Path | None = None  # SIMULATION.md, when simulate_run wrote it
    # What scaling an already scaled set with --ranks did to its straggler (scale.ScaleResult.slow_notes)
    scale_notes: list[str] = field(default_factory=list)
    # The cost of the simulated network's pauses given to the training thread's compute (CPU runs that measured it)
    wake: WakeAdjustment | None = None

    @property
    def per_rank_ms(self) -> list[float]:
        return [ns / 1e6 for ns in self.per_rank_ns]


def write_configs(work_dir: Path, network: Network, groups: dict[str, list[int]]) -> list[str]:
    """ASTRA-sim's input files in work_dir; returns the command-line flags that name them (relative to work_dir)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(work_dir / NETWORK_FILE, network_yaml(network))
    write_text_atomic(work_dir / SYSTEM_FILE, json.dumps(system_config(network), indent=4) + "\n")
    write_text_atomic(work_dir / MEMORY_FILE, json.dumps({"memory-type": "NO_MEMORY_EXPANSION"}, indent=4) + "\n")
    flags = [f"--system-configuration={SYSTEM_FILE}", f"--network-configuration={NETWORK_FILE}",
             f"--remote-memory-configuration={MEMORY_FILE}"]
    (work_dir / COMM_GROUP_FILE).unlink(missing_ok=True)
    if groups:
        # ASTRA-sim ignores a communicator file whose path contains "empty" (its "no file" value): the name is
        # given relative to the folder it runs in.
        write_text_atomic(work_dir / COMM_GROUP_FILE, json.dumps(groups, indent=4, sort_keys=True) + "\n")
        flags.append(f"--comm-group-configuration={COMM_GROUP_FILE}")
    return flags


def _failure_line(output: str, returncode: int = 0) -> str:
    """What went wrong: the first line of ASTRA-sim's output that says so (a critical or error log line, an
    exception), else the signal that killed it (its last line is then only where it was, an info line), else its last
    line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"\[(critical|error|C|E)\]|\[Error\]|what\(\)|terminate called|Assertion", line):
            line = re.sub(r"^\[[^\]]*\d\] ", "", line)  # its timestamp
            if "chunk_size > 0" in line:
                line += (" (the algorithm split a collective of a few bytes into empty chunks, an ASTRA-sim "
                         "limitation: use ring or direct)")
            group = re.search(r"communicator group (\d+) not found", line)
            if group:
                line += f" (the .et files record no process group {group.group(1)})"
            if "removed before call stoi" in line:
                line += " (a collective's pg_name that is not a number: ASTRA-sim takes it as a communicator id)"
            return line[-300:]
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}" + (" (ASTRA-sim crashed)" if name in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE",
                                                                         "SIGILL") else "")
    return lines[-1][-300:] if lines else "no output"


def _ending_with(parent: int):
    """preexec_fn that makes ASTRA-sim end with simulate.py (pid `parent`) on Linux: killed outright (kill -9, the
    OOM killer), simulate.py cannot stop it, and an orphan would run on for minutes, in a work folder the next
    simulation replaces under it. None elsewhere (no such request; Ctrl-C and SIGTERM still stop it)."""
    if not sys.platform.startswith("linux"):
        return None

    def end_with_simulate_py() -> None:
        die_with_parent()  # as the conversion's workers do
        if os.getppid() != parent:  # simulate.py died before the request took hold
            os._exit(1)
    return end_with_simulate_py


@contextmanager
def open_files_for(npus: int, binary: Path) -> Iterator[None]:
    """Let ASTRA-sim open a file per NPU: raise this process's soft limit of open files (which the simulator
    inherits) up to the hard one while it runs, or refuse in one line when the hard limit is too low. Below the limit
    ASTRA-sim exits 1 with nothing in its output that says why."""
    try:
        import resource
    except ImportError:  # Windows: no such limit to read
        yield
        return
    needed = npus + ASTRA_SIM_OTHER_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        yield
        return
    problem = open_file_limit_problem(npus)
    if problem:
        raise SimulationError(f"{binary}: {problem}")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    except (ValueError, OSError) as e:  # macOS caps the soft limit below an unlimited hard one (OPEN_MAX)
        raise SimulationError(f"{binary}: {npus} NPUs need {needed} open files (ASTRA-sim keeps each NPU's .et "
                              f"open), but the limit of {soft} (ulimit -n) cannot be raised ({e}); simulate fewer "
                              "ranks") from None
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def network_collectives(path: Path) -> list[tuple[str, int]]:
    """(collective type, bytes) of every collective in the .et that ASTRA-sim runs over the network (all-reduce,
    all-gather, reduce-scatter, all-to-all; a broadcast replays its traced duration), in the file's order."""
    from chakra.schema.protobuf.et_def_pb2 import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COMM_COLL_NODE,
                                                   REDUCE_SCATTER, Node)

    from .validate import EtFormatError, iter_et_messages

    networked = {ALL_REDUCE: "all-reduce", ALL_GATHER: "all-gather", REDUCE_SCATTER: "reduce-scatter",
                 ALL_TO_ALL: "all-to-all"}
    collectives, node = [], Node()
    try:
        messages = iter_et_messages(path)
        next(messages, None)  # the metadata
        for blob in messages:
            node.Clear()
            node.ParseFromString(blob)
            if node.type != COMM_COLL_NODE:
                continue
            attrs = {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr if a.WhichOneof("value")}
            if attrs.get("comm_type") in networked:
                collectives.append((networked[attrs["comm_type"]], int(attrs.get("comm_size") or 0)))
    except (EtFormatError, OSError) as e:
        raise SimulationError(f"{path}: cannot read the .et ({e})") from None
    except Exception as e:  # protobuf decode errors
        raise SimulationError(f"{path}: not a Chakra .et ({e})") from None
    return collectives


def serial_latencies(algorithm: str, kind: str, npus: int) -> int:
    """The link latencies ASTRA-sim puts one after another in one collective: it splits the collective into
    preferred-dataset-splits chunks and, with one chunk active at a time, runs the algorithm's steps chunk after
    chunk, each step a message that crosses at least one link. Measured with a 1 MiB collective on a FullyConnected
    network (one link a message; a Ring topology takes more hops for direct and tree messages):

    ring, oneRing: all-reduce 2(N-1) steps a chunk (reduce-scatter, then all-gather), all-gather and reduce-scatter
    N-1, all-to-all N(N-1)/2. direct, oneDirect: 2, 1, 1. halvingDoubling: 2 log2 N, log2 N. doubleBinaryTree
    all-reduce: 5, 13, 21 at 2, 4, 8 NPUs, the chunks pipelined down and up the tree (2 log2 N a chunk, less 3)."""
    splits = SYSTEM_DEFAULTS["preferred-dataset-splits"]
    base = algorithm[3].lower() + algorithm[4:] if algorithm.startswith("one") else algorithm
    log2 = max(1, (npus - 1).bit_length())
    if base == "doubleBinaryTree":  # an all-reduce only (NOT_IMPLEMENTED)
        return 2 * log2 * splits - 3
    steps = {
        "ring": {"all-reduce": 2 * (npus - 1), "all-to-all": npus * (npus - 1) // 2},
        "direct": {"all-reduce": 2},
        "halvingDoubling": {"all-reduce": 2 * log2},
    }[base]
    default = {"ring": npus - 1, "direct": 1, "halvingDoubling": log2}[base]
    return splits * steps.get(kind, default)


def step_floor(network: Network, collectives: list[tuple[str, int]]) -> tuple[int, float]:
    """(link latencies, transfer ns) that the collectives take at least one after another on this network (an NPU
    runs one collective at a time): each its serial_latencies, and at least B/N of its B bytes through one link."""
    algorithms = network.algorithms()
    bytes_per_ns = network.bandwidth_gbs * GIB / 1e9
    latencies = sum(serial_latencies(algorithms[kind], kind, network.npus) for kind, _ in collectives)
    return latencies, sum(size for _, size in collectives) / network.npus / bytes_per_ns


def check_clock_range(network: Network, collectives: list[tuple[str, int]]) -> None:
    """Refuse a --latency or --bandwidth with which a rank's collectives (network_collectives of its .et) outlast
    ASTRA-sim's clock (CLOCK_LIMIT_NS): it would simulate them as free, or stop with the ranks unfinished."""
    if not collectives:
        return
    latencies, transfer_ns = step_floor(network, collectives)
    latency_ns = latencies * network.latency_ns
    floor_ns = latency_ns + transfer_ns
    if floor_ns < CLOCK_LIMIT_NS:
        return
    flag = (f"--latency {network.latency_ns:g}" if latency_ns >= transfer_ns
            else f"--bandwidth {network.bandwidth_gbs:g}")
    count = len(collectives)
    what = (f"a collective of {collectives[0][1]:,} bytes" if count == 1 else
            f"the {count} collectives of a step ({sum(size for _, size in collectives):,} bytes)")
    raise SimulationError(f"{flag}: {what} over {network.npus} NPUs would take at least {floor_ns:.3g} ns on this "
                          f"network ({latencies:,} link latencies one after another, {transfer_ns:.3g} ns of "
                          "transfer), beyond the 2^53 ns (104 days) ASTRA-sim's clock counts (it "
                          "would simulate the collectives as free, or stop); give a network of real-world latency and "
                          "bandwidth")


def simulate_workload(workload_prefix: Path, ranks: int, *, bandwidth_gbs: float,
                      latency_ns: float = DEFAULT_LATENCY_NS, topology: str = "Ring", collective: str = "ring",
                      binary: Path | None = None, work_dir: Path | None = None,
                      timeout_s: float | None = None,
                      progress: Callable[[str], None] | None = None) -> SimulationResult:
    """Simulate `<workload_prefix>.<rank>.et` for ranks 0..ranks-1 on one network dimension of `ranks` NPUs.

    Args:
        workload_prefix: the path before `.<rank>.et`, as ASTRA-sim's --workload-configuration takes it.
        bandwidth_gbs: per-link bandwidth in ASTRA-sim's GB/s (2^30 bytes; see parse_bandwidth).
        binary: ASTRA-sim's analytical congestion-unaware binary (default: find_astra_sim()).
        work_dir: where the configuration files, ASTRA-sim's output and its log/ go (default: a new temp folder).
        progress: called with a line every PROGRESS_EVERY_S while ASTRA-sim runs.
    """
    network = Network(ranks, bandwidth_gbs, latency_ns, topology, collective)
    workload = Path(workload_prefix).absolute()
    paths = [workload.parent / et_name(workload.name, r) for r in range(ranks)]
    missing = [path for path in paths if not path.is_file()]
    if missing:
        raise SimulationError(f"{missing[0]}: missing ({len(missing)} of the {ranks} ranks' .et files are)")
    binary = find_astra_sim(binary) if binary is not None else find_astra_sim()
    check_clock_range(network, network_collectives(paths[0]))
    work_dir = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="astra-sim-"))
    flags = write_configs(work_dir, network, process_groups(workload, ranks))
    # A set inside the work folder (scaled there) is named relative to it, as the configuration files are: the
    # command stays right when the folder is renamed into place (simulate_run).
    try:
        named = workload.relative_to(work_dir.absolute())
    except ValueError:
        named = workload
    command = [str(binary), f"--workload-configuration={named}", *flags, f"--logging-folder={LOG_DIR}"]
    shutil.rmtree(work_dir / LOG_DIR, ignore_errors=True)  # ASTRA-sim appends: the log would hold every earlier run
    with open_files_for(ranks, binary):
        proc = subprocess.Popen(command, cwd=work_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace", preexec_fn=_ending_with(os.getpid()))
        try:
            stdout, stderr = _wait_telling(proc, timeout_s, progress, f"ASTRA-sim on {ranks} NPUs")
            if stdout is None:
                raise SimulationError(f"{binary}: still running after {timeout_s:g} s; stopped")
        except BaseException:  # the timeout, Ctrl-C, SIGTERM: ASTRA-sim is stopped with this
            proc.kill()
            proc.wait()
            raise
    output = stdout + (stderr or "")
    write_text_atomic(work_dir / OUTPUT_FILE, output)
    finished: dict[int, tuple[int, int]] = {}
    for match in FINISHED_RE.finditer(output):
        finished[int(match.group(1))] = (int(match.group(2)), int(match.group(3)))
    if proc.returncode != 0:
        status = f"exit status {proc.returncode}: " if proc.returncode > 0 else ""
        raise SimulationError(f"{binary}: {status}{_failure_line(output, proc.returncode)} (all output: "
                              f"{work_dir / OUTPUT_FILE})")
    unfinished = [r for r in range(ranks) if r not in finished]
    if not finished and not ASTRA_SIM_LOG_RE.search(output):
        # Not one line in ASTRA-sim's log format: another program at that path (a wrapper, a wrong binary; one that
        # printed nothing had been blamed on "a collective no other rank joined")
        said = " ".join(output.split())
        said = repr(said if len(said) <= 80 else said[:77] + "...") if said else "nothing"
        raise SimulationError(f"{binary}: printed {said}, which is not ASTRA-sim's output (no rank finished); is "
                              f"it the {BINARY_NAME} binary? output: {work_dir / OUTPUT_FILE}")
    if unfinished:
        said = _failure_line(output) if re.search(r"\[(critical|error)\]", output) else \
            "nothing (a collective no other rank joined?)"
        raise SimulationError(f"{binary}: rank(s) {', '.join(map(str, unfinished[:8]))} never finished; ASTRA-sim "
                              f"said: {said}; output: {work_dir / OUTPUT_FILE}")
    per_rank = [finished[r][0] for r in range(ranks)]
    return SimulationResult(per_rank_ns=per_rank, step_ms=max(per_rank) / 1e6, workload=workload, network=network,
                            command=command, work_dir=work_dir,
                            exposed_comm_ns=[finished[r][1] for r in range(ranks)], traced_ranks=ranks)


def _wait_telling(proc: subprocess.Popen, timeout_s: float | None, progress: Callable[[str], None] | None,
                  what: str) -> tuple[str | None, str | None]:
    """proc's stdout and stderr once it ends, telling progress every PROGRESS_EVERY_S that it still runs; (None, None)
    past timeout_s (the caller stops it). communicate() may be called again after its timeout without losing output."""
    started = time.monotonic()
    while True:
        elapsed = time.monotonic() - started
        if timeout_s is not None and elapsed >= timeout_s:
            return None, None
        wait = PROGRESS_EVERY_S if timeout_s is None else min(PROGRESS_EVERY_S, timeout_s - elapsed)
        try:
            return proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            if progress is not None and (timeout_s is None or time.monotonic() - started < timeout_s):
                minutes, seconds = divmod(round(time.monotonic() - started), 60)
                progress(f"... {what}: still running, {minutes} min {seconds:02d} s so far")


# ---------------------------------------------------------------------------------------------------------------
# Compute after a pause: the simulated network's pauses, not the traced one's (trace_tools.wake_cost)
# ---------------------------------------------------------------------------------------------------------------
def simulate_with_wake_cost(workload: Path, ranks: int, work_dir: Path, network: dict,
                            progress: Callable[[str], None] | None = None) -> SimulationResult:
    """simulate_workload, then, where the .et files record the machine's wake cost (CPU runs), again with each rank's
    training thread given the cost of its pauses in the simulated step instead of those of the traced step, until
    the pauses it is given the cost of are the pauses it simulates to (within WAKE_SETTLED of its compute; at most
    WAKE_SIMULATIONS simulations). The copies go to work_dir/WAKE_COST_DIR; result.wake says what each rank got."""
    result = simulate_workload(workload, ranks, work_dir=work_dir, progress=progress, **network)
    sources = _training_threads(workload, ranks)
    if sources is None:
        return result
    threads = {rank: thread for rank, (_, thread) in sources.items() if thread is not None}
    adjustment = WakeAdjustment(cost=threads[0].wake_cost)
    applied = {rank: 0.0 for rank in threads}
    wake_dir = work_dir / WAKE_COST_DIR
    while True:
        wanted = {}
        for rank, thread in threads.items():
            pause = max(0.0, result.per_rank_ns[rank] / 1e3 - (thread.compute_us + applied[rank]))
            wanted[rank] = (thread.wake_cost.extra(pause, thread.compute_us)
                            - thread.wake_cost.extra(thread.traced_pause_us, thread.compute_us))
            adjustment.ranks[rank] = RankWake(thread.traced_pause_us, pause, applied[rank], thread.compute_us)
        settled = all(abs(wanted[rank] - applied[rank]) <= WAKE_SETTLED * thread.compute_us
                      for rank, thread in threads.items())
        if settled or adjustment.simulations >= WAKE_SIMULATIONS:
            break
        applied = wanted
        copies = _with_compute_changed(workload, ranks, sources, applied, wake_dir)
        result = simulate_workload(copies, ranks, work_dir=wake_dir, progress=progress, **network)
        adjustment.simulations += 1
    result.wake = adjustment
    return result


def _training_threads(workload: Path, ranks: int) -> dict[int, tuple[SourceEt, TrainingThread | None]] | None:
    """Each rank's .et as read (one object for the ranks of a file: a scaled set's hard links are one) and its training
    thread (None where it records none), or None when rank 0's .et records no wake cost."""
    found: dict[tuple[int, int], tuple[SourceEt, TrainingThread | None]] = {}
    sources = {}
    for rank in range(ranks):
        path = workload.parent / et_name(workload.name, rank)
        key = _same_file_key(path)
        if key not in found:
            source = _source_et(path)
            found[key] = (source, training_thread(source.blobs, source.meta))
        if rank == 0 and found[key][1] is None:
            return None
        sources[rank] = found[key]
    return sources


def _with_compute_changed(workload: Path, ranks: int, sources: dict[int, tuple[SourceEt, TrainingThread | None]],
                          change_us: dict[int, float], out_dir: Path) -> Path:
    """A copy of the set in out_dir (`sources`: _training_threads) with each rank's training-thread nodes lasting
    change_us[rank] more in all (the first rank of a file shared by several decides its change); its workload
    prefix."""
    from .scale import link_or_copy

    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[int, Path] = {}  # by id() of the source: one per file
    for rank in range(ranks):
        (source, thread), out = sources[rank], out_dir / et_name(workload.name, rank)
        if id(source) in written:
            out.unlink(missing_ok=True)
            link_or_copy(written[id(source)], out)
            continue
        factor = 1.0 if thread is None else max(0.0, (thread.compute_us + change_us[rank]) / thread.compute_us)
        _scaled_copy(out, factor, [] if thread is None else thread.indices, source.blobs, source.metadata)
        written[id(source)] = out
    return out_dir / workload.name


def _scaled_copy(out_path: Path, factor: float, indices: list[int], blobs: list[bytes], metadata) -> None:
    """out_path: an .et (its metadata and serialized nodes, `blobs`) with the nodes at `indices` factor times as
    long, in all to the µs: each is rounded with what the ones before it were rounded by carried over (rounded one by
    one, the thousands of 1-16 µs ops of a small model would not change at all by 3%)."""
    from chakra.schema.protobuf.et_def_pb2 import Node
    from chakra.src.third_party.utils.protolib import encodeMessage

    chosen = set(indices)
    node = Node()
    wanted = written = 0.0
    with atomic_output(out_path) as f:
        encodeMessage(f, metadata)
        for index, blob in enumerate(blobs):
            if index in chosen:
                node.Clear()
                node.ParseFromString(blob)
                wanted += node.duration_micros * factor
                node.duration_micros = max(0, round(wanted - written))
                written += node.duration_micros
                blob = node.SerializeToString()
            encodeMessage(f, SerializedMessage(blob))


def _source_et(path: Path) -> SourceEt:
    """One .et of the set as trace_tools.scale reads it; SimulationError when it cannot be read."""
    from .scale import ScaleError, read_source_et

    try:
        return read_source_et(path)
    except ScaleError as e:
        raise SimulationError(str(e)) from None


def _same_file_key(path: Path) -> tuple[int, int]:
    """Hard links of a scaled set are one file."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


# ---------------------------------------------------------------------------------------------------------------
# The communication threads' CPU time, measured on the traced network only
# ---------------------------------------------------------------------------------------------------------------
def without_communication_cpu(workload: Path, ranks: int, out_dir: Path) -> Path | None:
    """A copy of the .et set in out_dir with every communication-CPU node at 0 µs; its workload prefix, or None
    when rank 0's .et has no such node (a GPU run, a run whose gloo threads were not timed).

    On a CPU run each collective has a CPU node with gloo's threads' CPU time as measured on the traced network
    (trace_tools.core_sharing). That time is not the same on another network: on a paced link gloo's threads are
    woken for every few packets, and an 8 MB all-reduce cost them 1.8-3.5x the CPU of a full-speed one on the 2-core
    VM (bench/communication_cpu.py, docs/BENCHMARKS.md §4b). How much less a faster network costs, one trace does not
    tell. So simulated on a network faster than the traced one, the step lies between the step of this copy (the
    communication costing no CPU) and the step of the .et as converted, or below both where the training thread,
    interrupted less often by those threads, spent less CPU too (BERT 6 x 384 traced at 1 Gbit/s: 7-9% below this
    copy's step at full speed, docs/BENCHMARKS.md §4, session 48)."""
    from .scale import link_or_copy

    out_dir.mkdir(parents=True, exist_ok=True)
    copy_of: dict[tuple[int, int], Path] = {}  # a scaled set's hard links are one file: one copy, linked again
    for rank in range(ranks):
        path, out = workload.parent / et_name(workload.name, rank), out_dir / et_name(workload.name, rank)
        key = _same_file_key(path)
        if key in copy_of:
            link_or_copy(copy_of[key], out)
            continue
        source = _source_et(path)
        if rank == 0 and not source.communication_cpu_indices:
            return None
        _scaled_copy(out, 0.0, source.communication_cpu_indices, source.blobs, source.metadata)
        copy_of[key] = out
    return out_dir / workload.name


# ---------------------------------------------------------------------------------------------------------------
# A converted run: its .et set, its measured steps, SIMULATION.md
# ---------------------------------------------------------------------------------------------------------------
def _summary_status(folder: Path, name: str | None = None) -> dict[int, dict]:
    """Per-rank results recorded in the folder's CONVERSION_SUMMARY.md for the set `name` (any set when None; empty
    when there is none)."""
    previous = read_previous_results(folder) or {}
    return {rank: {"traced_step_us": r.traced_step_us, "critical_path_us": r.critical_path_us}
            for rank, r in previous.items() if r.ok and name in (None, r.run)}


def _median_seconds(value) -> float | None:
    values = value if isinstance(value, list) else [value]
    numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
    return statistics.median(numbers) if numbers else None


def _untraced_spread_note(samples: dict) -> str:
    """The ranks whose untraced steps lie further from their median than the fidelity bound: their measured step,
    and a predicted / measured ratio against it, is not known to that bound (StepTimes.untraced_deviation)."""
    loose = [f"rank {rank} {times.untraced_deviation:.0%} ({len(times.untraced_us)} steps)"
             for rank, times in sorted(samples.items()) if times.untraced_deviation > STEP_SPREAD_BOUND]
    if not loose:
        return ""
    return (f"; the untraced steps lie typically further than {STEP_SPREAD_BOUND:.0%} from their median on "
            + ", ".join(loose) + ", so the measured step is not known to that bound")


def measured_steps(folder: Path, name: str | None = None) -> tuple[dict[int, float], str]:
    """Measured step per rank in ms, and where it comes from: run.json's untraced steps (what the .et durations
    estimate: the run's first step, its start-up, left out as the conversion leaves it out, trace_tools.step_timing),
    else its traced steps, else the traced step in CONVERSION_SUMMARY.md. run.json is the one of the run the .et
    files were made from (summary.run_info_files: beside them, in their trace folder, or, that run traced again
    since, in its .previous/ folder). A damaged run.json, or another run's, is passed over, and the source says so,
    as it says where run.json was looked for when there is none. With `name`, the set simulated: only the set
    CONVERSION_SUMMARY.md records has the run's steps (another set in the folder, a scaled one, has none)."""
    if name is not None and not records_set(folder, name):
        return {}, f"none: {unmeasured_set(folder, name)}"
    traces = converted_from(folder)
    run = ConvertedRun.recorded_in(folder)
    candidates, previous = run_info_files(folder)
    note, read_one, other_run = "", False, False
    for candidate in candidates:
        info, problem = read_run_info(candidate)
        if candidate == previous and not run.holds(candidate, info):
            continue  # an earlier run's, or not known to be this one's
        read_one = True
        if problem:
            note += f"; passed over {problem}"
            continue
        other = run.other_run(candidate, info)
        if other:
            note += f"; passed over {candidate}: {other}"
            other_run = True
            continue
        entries = info.get("ranks") or []
        samples = {entry["rank"]: times for entry in entries
                   if (times := step_times_of(info, entry["rank"])) is not None}
        if samples:
            return ({rank: times.untraced_median_us / 1e3 for rank, times in samples.items()},
                    "untraced steps after the run's first, median per rank (`untraced_step_wall_time_s` "
                    f"in {candidate}){_untraced_spread_note(samples)}{note}")
        traced = {entry["rank"]: seconds * 1e3 for entry in entries
                  if (seconds := _median_seconds(entry.get("step_wall_time_s"))) is not None}
        if traced:
            return traced, f"traced steps, median per rank (`step_wall_time_s` in {candidate}){note}"
    if other_run:
        note += f"; {reconvert_command(folder)} converts the traces as they are now"
    status = _summary_status(folder)
    steps = {rank: s["traced_step_us"] / 1e3 for rank, s in status.items() if s["traced_step_us"]}
    if steps:
        if not read_one:  # the traced step is not what the .et durations estimate: say where run.json was sought
            elsewhere = traces is not None and traces.resolve() != folder.resolve()
            note = (f"; no {RUN_INFO} beside the .et files"
                    + (f" or in {traces}, the trace folder {CONVERSION_SUMMARY} names" if elsewhere else ""))
        return steps, f"traced step ({CONVERSION_SUMMARY} in {folder}){note}"
    return {}, f"none found (no usable run.json, no CONVERSION_SUMMARY.md){note}"


def unmeasured_set(folder: Path, name: str) -> str:
    """Why the set `name`, which the folder's CONVERSION_SUMMARY.md does not record, has no measured step: the run's
    run.json and traced step are another set's (a set copied in beside the converted one), or it was scaled."""
    try:
        from .scale import read_scale_status
    except ImportError:
        read_scale_status = None
    scale = read_scale_status(folder) if read_scale_status is not None else None
    if scale and scale.get("name") == name:
        return (f"{name} was scaled to {scale.get('ranks')} ranks by scale_et.py (SCALE_SUMMARY.md); no step was "
                "measured at that scale")
    if (folder / CONVERSION_SUMMARY).is_file():
        if read_previous_results(folder) is None:
            return (f"{folder / CONVERSION_SUMMARY} holds no conversion record (damaged, or not written by "
                    f"convert_to_et.py), so no run.json or traced step is known to be {name}'s; "
                    f"{reconvert_command(folder)} writes it again")
        return f"{name} is not the set {CONVERSION_SUMMARY} records"
    return f"no {CONVERSION_SUMMARY} in {folder} records {name}, so no run.json or traced step is known to be its"


def check_against_summary(workload: Path, ranks: int) -> None:
    """Refuse a set whose .et files are not those the folder's CONVERSION_SUMMARY.md recorded as converted
    (summary.unrecorded_et_file), or, for a scaled set, those its SCALE_SUMMARY.md recorded as written
    (scale.unscaled_et_file): ASTRA-sim would simulate another run's rank, a rank re-written since, or what is left
    of a file cut short."""
    problem = unrecorded_et_file(workload.parent, workload.name, range(ranks))
    if problem is None:
        try:
            from .scale import unscaled_et_file
        except ImportError:  # a checkout without the scaler: no scaled set of its own to check
            unscaled_et_file = None
        # ranks missing from the top are refused by process_groups, which names the world size the files record
        if unscaled_et_file is not None:
            problem = unscaled_et_file(workload.parent, workload.name, range(ranks), every_recorded_rank=False)
    if problem:
        raise SimulationError(f"{problem[0]}: {problem[1]}")
    if not _recorded_by_a_summary(workload.parent, workload.name):
        check_unrecorded_set(workload, ranks)


def _recorded_by_a_summary(folder: Path, name: str) -> bool:
    """Whether the folder's CONVERSION_SUMMARY.md or SCALE_SUMMARY.md records the set `name` (whose files
    check_against_summary then holds to the fingerprints recorded)."""
    if records_set(folder, name):
        return True
    try:
        from .scale import read_scale_status
    except ImportError:
        return False
    return (read_scale_status(folder) or {}).get("name") == name


def check_unrecorded_set(workload: Path, ranks: int) -> None:
    """Refuse .et files that no summary vouches for (copied from elsewhere) when ASTRA-sim could not run them as one
    run: a file that does not decode whole (cut short, empty, not a .et) or fails validation, or ranks whose
    collectives disagree (ranks of different runs), which would hang the simulation or end it early. Ranks that
    share a file (a scaled set's hard links) are checked once."""
    reports, members, checked = {}, {}, {}
    for rank in range(ranks):
        path = workload.parent / et_name(workload.name, rank)
        stat = path.stat()
        key = (stat.st_dev, stat.st_ino)
        if key not in checked:
            report = validate_et(path)
            if not report.ok:
                problem = report.problems[0]
                problem = problem[len(str(path)) + 2:] if problem.startswith(f"{path}: ") else problem
                raise SimulationError(f"{path}: {problem}; ASTRA-sim cannot run it (convert the run again)")
            checked[key] = report
            members.update(listed_groups(et_metadata(path), ranks))
        misnamed = misnamed_rank(path, rank, checked[key].rank)
        if misnamed:
            raise SimulationError(misnamed)
        reports[rank] = checked[key]
    process_groups(workload, ranks)  # a world size other than the set's, or groups the ranks disagree on
    disagreement = collectives_agree({rank: report.collectives for rank, report in reports.items()}, members)
    if disagreement:
        raise SimulationError(f"{workload.parent}: the ranks of {workload.name} do not run the same collectives "
                              f"({disagreement[0]}): .et files of different runs, which ASTRA-sim cannot run together")


def simulate_run(run_dir: Path, *, ranks: int | None = None, work_dir: Path | None = None,
                 communication_cpu_bound: bool = True, assume_data_parallel: bool = False,
                 invocation: str | None = None, progress: Callable[[str], None] | None = None,
                 wake_cost: bool = True, **network) -> SimulationResult:
    """Simulate a converted run (its <name>.<rank>.et set) on the given network, with `ranks` NPUs (default: as
    many as were traced; more are made by trace_tools.scale.scale_run first, which assume_data_parallel lets scale
    a run that has no run.json saying it is data-parallel). The result carries the measured step
    per rank and the critical path of each rank's .et when the run folder records them, and (communication_cpu_bound,
    on a CPU run) the step simulated again without the communication threads' CPU time (without_communication_cpu).
    With wake_cost, a CPU run's training thread has the cost of the simulated network's pauses instead of the traced
    one's, where the .et files record it (simulate_with_wake_cost).

    ASTRA-sim's files go to a staging folder beside work_dir (default <run>/astra-sim/), renamed over work_dir only
    when the simulation succeeds, together with SIMULATION.md when `invocation` (the command line it records) is
    given: work_dir keeps the files of the simulation SIMULATION.md describes, whatever stops a later one. `progress`
    is told, a line at a time, what a long simulation is doing (simulate_workload)."""
    run_dir = Path(run_dir)
    folder = run_dir if run_dir.is_dir() else run_dir.parent
    if not folder.is_dir():
        find_workload(run_dir)  # says what is missing
    # Simulations and reports side by side, none while a conversion rewrites the .et files (pipeline's lock): it
    # would call the ranks still to come interrupted, and remove the files under ASTRA-sim.
    with folder_held(folder, lambda: SimulationError(f"{folder}: a conversion is writing into this folder now; "
                                                     "simulate the run when it has ended"), shared=True):
        workload, traced = find_workload(run_dir)
        check_against_summary(workload, traced)
        folder = workload.parent
        work_dir = Path(work_dir) if work_dir is not None else folder / WORK_DIR_NAME
        if ranks is None:
            if traced < 2:
                raise SimulationError(f"{workload.parent / et_name(workload.name, 0)}: a one-rank run; "
                                      f"{ONE_NPU_PROBLEM}")
            ranks = traced
        # a scaled set holds more files than the run was traced on: it scales again down to those (scale_et.py does)
        least = traced_world_size(workload) or traced
        if ranks < least:
            raise SimulationError(f"--ranks {ranks}: the run has {least} traced ranks; simulate at least as many")
        # the network ASTRA-sim cannot run (a power-of-two algorithm on 3 NPUs) refused before any file is written
        Network(ranks, **{key: network[key] for key in ("bandwidth_gbs", "latency_ns", "topology", "collective")
                          if key in network})
        problem = open_file_limit_problem(ranks)
        if problem:  # before the scaled set's N files are written
            raise SimulationError(f"--ranks {ranks}: {problem}")
        if invocation is not None and (folder / SIMULATION_FILE).is_dir():  # said now, not after the simulation
            raise SimulationError(f"{folder / SIMULATION_FILE}: a folder, where simulate.py writes its summary; move "
                                  "it away and simulate again")
        made_work_dir = not work_dir.exists()
        try:
            work_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SimulationError(f"{work_dir}: cannot write ASTRA-sim's files there ({e.strerror or e})") from None
        try:
            # One simulation at a time in a work folder: two would replace it under each other.
            with folder_held(work_dir, lambda: SimulationError(f"{work_dir}: another simulation of this run is "
                                                               "running there now; wait for it to end")), \
                    staged(work_dir) as staging:
                result = _simulate_run(workload, traced, ranks, staging, communication_cpu_bound, network,
                                       assume_data_parallel=assume_data_parallel, progress=progress,
                                       published_dir=work_dir, wake_cost=wake_cost)
                publish(result, staging, work_dir, invocation)
        except BaseException:
            if made_work_dir:  # a first simulation that failed leaves no empty astra-sim/ behind
                try:
                    work_dir.rmdir()
                except OSError:
                    pass
            raise
        return result


def _simulate_run(workload: Path, traced: int, ranks: int, work_dir: Path, communication_cpu_bound: bool,
                  network: dict, *, assume_data_parallel: bool = False, progress: Callable[[str], None] | None = None,
                  published_dir: Path | None = None, wake_cost: bool = True) -> SimulationResult:
    """The simulation in work_dir (a staging folder that becomes published_dir when given)."""
    folder, traced_name = workload.parent, workload.name
    if ranks != traced:  # more ranks, or fewer than a scaled set holds (still as many as it was traced on)
        try:
            from .scale import ScaleError, scale_set
        except ImportError as e:
            raise SimulationError(f"--ranks {ranks}: other than the set's {traced} ranks needs trace_tools.scale, "
                                  f"which this checkout does not have: scaling is unavailable ({e})") from e
        try:
            # The prefix, not the folder: a folder of several sets would otherwise scale the one named after it.
            scaled_dir = SCALED_DIR.format(ranks=ranks)
            written = scale_set(workload, ranks, output_dir=work_dir / scaled_dir,
                                assume_data_parallel=assume_data_parallel,
                                published_dir=published_dir / scaled_dir if published_dir else None)
        except ScaleError as e:  # a flag's problem is a usage error, the run's is not (as in scale_et.py)
            raise SimulationError(f"--ranks {ranks}: {e}", usage=e.where.startswith("--")) from e
        except InterruptedAfterWriting:  # the scaled set is in the staging folder, removed: nothing was simulated
            raise KeyboardInterrupt from None
        workload, scale_notes = Path(written.prefix), list(written.slow_notes)
    else:
        scale_notes = []
    result = (simulate_with_wake_cost(workload, ranks, work_dir, network, progress) if wake_cost
              else simulate_workload(workload, ranks, work_dir=work_dir, progress=progress, **network))
    result.scale_notes = scale_notes
    # A scaled set simulated as it is was still traced on fewer ranks: SIMULATION.md says so.
    result.traced_ranks, result.run_folder = traced_world_size(workload) or traced, folder
    if communication_cpu_bound:
        bound_dir = work_dir / WITHOUT_COMMUNICATION_CPU_DIR
        zeroed = without_communication_cpu(result.workload, ranks, bound_dir)
        if zeroed is not None:
            result.without_communication_cpu_ms = simulate_workload(zeroed, ranks, work_dir=bound_dir,
                                                                    progress=progress, **network).step_ms
    if ranks != traced:
        # The run's steps and the converted .et files' critical paths are of its traced ranks, not of the scaled set
        # simulated: none here, as for a set scale_et.py wrote (unmeasured_set). The 2-rank measured step had been
        # set against an 8-rank prediction, and the unscaled files' critical path shown for the scaled ones.
        result.measured_ms, result.measured_source = {}, (
            f"none: {traced_name} was traced on {result.traced_ranks} ranks and simulated scaled to {ranks} "
            "(--ranks); no step was measured at that scale")
        return result
    result.measured_ms, result.measured_source = measured_steps(folder, traced_name)
    status = _summary_status(folder, traced_name)  # another set's critical path is not this one's
    result.critical_path_ms = {rank: s["critical_path_us"] / 1e3 for rank, s in status.items()
                               if s["critical_path_us"]}
    return result


@contextmanager
def staged(work_dir: Path) -> Iterator[Path]:
    """A new staging folder beside work_dir for one simulation's files, removed when the block ends (publish renames
    it over work_dir first when the simulation succeeds); a simulation that failed in ASTRA-sim is kept as
    <work_dir>.failed/ (keep_failed)."""
    remove_dead_staging(work_dir)
    staging = Path(tempfile.mkdtemp(prefix=f".{work_dir.name}.staging-{os.getpid()}-", dir=work_dir.parent)).absolute()
    try:
        yield staging
    except SimulationError as e:
        raise SimulationError(keep_failed(staging, work_dir, str(e)), usage=e.usage) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remove_dead_staging(work_dir: Path) -> None:
    """The staging folders of simulations that were killed (kill -9, a power cut) before they could remove them."""
    try:
        entries = list(os.scandir(work_dir.parent))
    except OSError:
        return
    for entry in entries:
        match = STAGING_RE.fullmatch(entry.name)
        if match and match["work"] == work_dir.name and not process_is_alive(int(match["pid"])):
            shutil.rmtree(entry.path, ignore_errors=True)


def keep_failed(staging: Path, work_dir: Path, problem: str) -> str:
    """The problem of a simulation that failed, its staging folder kept as <work_dir>.failed/ when the problem
    points into it (ASTRA-sim's output), else removed; work_dir keeps the last simulation that succeeded."""
    if str(staging) not in problem:
        return problem
    failed = work_dir.with_name(work_dir.name + FAILED_SUFFIX)
    shutil.rmtree(failed, ignore_errors=True)
    try:
        os.rename(staging, failed)
    except OSError:
        return problem
    return problem.replace(str(staging), str(failed))


def publish(result: SimulationResult, staging: Path, work_dir: Path, invocation: str | None) -> None:
    """Rename the staged simulation over work_dir (the earlier one removed) and, with an invocation, write
    SIMULATION.md beside the .et set; the result's paths are made those of work_dir."""
    result.work_dir = work_dir
    try:
        result.workload = work_dir / result.workload.relative_to(staging)
    except ValueError:
        pass
    replaced = staging.with_name(staging.name + ".replaced")  # STAGING_RE's: removed after a kill too
    summary = result.run_folder / SIMULATION_FILE
    try:
        with publication(lambda: result.simulation_file or work_dir):
            try:
                if invocation is not None:
                    with atomic_path(summary) as tmp:
                        tmp.write_text(render_simulation(result, invocation), encoding="utf-8")
                        _replace_folder(staging, work_dir, replaced)
                    result.simulation_file = summary
                else:
                    _replace_folder(staging, work_dir, replaced)
            except OSError as e:  # the folder and SIMULATION.md go together or not at all
                where = summary if invocation is not None and not staging.exists() else work_dir  # failed after both
                _restore_folder(staging, work_dir, replaced)
                raise SimulationError(f"{where}: cannot publish the simulation ({e.strerror or e}); "
                                      f"{SIMULATION_FILE} and {work_dir.name}/ are kept as they were") from None
    except InterruptedAfterWriting:
        shutil.rmtree(replaced, ignore_errors=True)
        raise
    shutil.rmtree(replaced, ignore_errors=True)
    shutil.rmtree(work_dir.with_name(work_dir.name + FAILED_SUFFIX), ignore_errors=True)  # an earlier failure's


def _replace_folder(new: Path, old: Path, aside: Path) -> None:
    os.chmod(new, 0o777 & ~_umask())  # mkdtemp makes 0700 folders
    if old.is_dir():
        os.rename(old, aside)
    os.rename(new, old)


def _restore_folder(new: Path, old: Path, aside: Path) -> None:
    """Undo _replace_folder as far as it went: the new folder back to `new` (removed with the staging), the earlier
    one back from `aside`."""
    if not new.exists() and old.is_dir():
        os.rename(old, new)
    if aside.is_dir() and not old.exists():
        os.rename(aside, old)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _ms(value: float | None) -> str:
    return f"{value:,.1f}" if value else "-"


def result_rows(result: SimulationResult) -> list[tuple[str, ...]]:
    rows = [("rank", "predicted (ms)", "measured (ms)", "predicted / measured", ".et critical path (ms)")]
    for rank, predicted in enumerate(result.per_rank_ms):
        measured = result.measured_ms.get(rank)
        ratio = f"{predicted / measured:.3f}" if measured else "-"
        rows.append((str(rank), _ms(predicted), _ms(measured), ratio, _ms(result.critical_path_ms.get(rank))))
    return rows


TABLE_RANKS = 16  # above this many ranks the printed table gives ranks with the same numbers one line


def render_table(result: SimulationResult) -> str:
    """The plain-text table printed after a simulation: one line per rank, or, above TABLE_RANKS ranks (a set scaled
    to 1024 replays a few traced ranks), one line per distinct row with the ranks it stands for; SIMULATION.md keeps
    every rank."""
    rows = result_rows(result)
    if len(rows) - 1 > TABLE_RANKS:
        groups: dict[tuple[str, ...], list[int]] = {}
        for row in rows[1:]:
            groups.setdefault(row[1:], []).append(int(row[0]))
        rows = [rows[0]] + [(rank_list(ranks), *cells) for cells, ranks in groups.items()]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(widths[c]) if c else cell.ljust(widths[c]) for c, cell in enumerate(row))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def rank_list(ranks: list[int]) -> str:
    """Ascending ranks in few characters: '3', '0-1023', '0-1022 step 2 (512 ranks)', or the first ones and a count."""
    if len(ranks) == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"{ranks[0]}-{ranks[-1]}" + ("" if step == 1 else f" step {step} ({len(ranks)} ranks)")
    return f"{', '.join(map(str, ranks[:3]))}, ... ({len(ranks)} ranks)"


def render_simulation(result: SimulationResult, invocation: str) -> str:
    """SIMULATION.md: the network, the commands, and predicted vs measured step per rank."""
    rows = result_rows(result)
    scaled = (f" (scaled from the {result.traced_ranks} traced ranks)" if result.traced_ranks
              and result.traced_ranks != result.network.npus else "")
    lines = [
        f"# Simulation: {result.workload.name}",
        "",
        f"Simulated {datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')} with ASTRA-sim's analytical backend "
        "(congestion unaware).",
        "",
        f"- network: {result.network.describe()}{scaled}",
        f"- predicted step: **{result.step_ms:,.1f} ms** (the slowest rank)",
        *([f"- {bound_line(result)}"] if result.without_communication_cpu_ms is not None else []),
        *([f"- {result.wake.line()}"] if result.wake and result.wake.ranks else []),
        f"- measured: {result.measured_source}",
        *[f"- scaling: {note}" for note in result.scale_notes],
        *([f"- note: {result.network.caveat()}"] if result.network.caveat() else []),
        f"- command: `{invocation}`",
        f"- ASTRA-sim: `cd {shlex.quote(str(Path(result.work_dir).absolute()))} && {shlex.join(result.command)}`",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "|".join("---:" for _ in rows[0]) + "|",
        *["| " + " | ".join(row) + " |" for row in rows[1:]],
        "",
        "Predicted: the cycle at which ASTRA-sim finished the rank (1 cycle = 1 ns). The .et critical path is the "
        "step replayed with every collective at its traced duration (CONVERSION_SUMMARY.md); the difference is "
        "what the simulated network changes. The measured step is the run's, on the network it was traced on: "
        "simulated on another network, predicted / measured is the change the simulator predicts, not its error.",
        "",
    ]
    return "\n".join(lines)


def bound_line(result: SimulationResult) -> str:
    """What the step would be if the communication cost no CPU, and why that bounds the step on a faster network."""
    return (f"without the communication threads' CPU time: {result.without_communication_cpu_ms:,.1f} ms. That time "
            "was measured on the traced network, and gloo spends less CPU per byte on a faster one: simulated on a "
            "network faster than the traced one, the real step lies between the two, or below both where gloo's "
            "threads, woken less often, also took less CPU from the training thread.")


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="simulate.py",
        description="Simulate a converted run (<name>.<rank>.et files) in ASTRA-sim's analytical backend on a chosen "
        "network; print the predicted step per rank beside the measured one and write SIMULATION.md into the run "
        f"folder. ASTRA-sim's input files and output go to RUN_DIR/{WORK_DIR_NAME}/.")
    parser.add_argument("run", metavar="RUN_DIR", type=path_argument,
                        help="a converted run folder (or a workload prefix dir/name)")
    parser.add_argument("--bandwidth", required=True, metavar="RATE",
                        help="per-link bandwidth: 100Mbit/s, 2Gbit/s, 12.5GB/s (SI prefixes; Ki/Mi/Gi binary), or a "
                        "plain number in ASTRA-sim's GB/s of 2^30 bytes")
    parser.add_argument("--latency", type=float, default=DEFAULT_LATENCY_NS, metavar="NS",
                        help=f"per-link latency in ns (default {DEFAULT_LATENCY_NS:g})")
    parser.add_argument("--topology", default="Ring", metavar="NAME", help=f"{', '.join(TOPOLOGIES)} (default Ring)")
    parser.add_argument("--collective", default="ring", metavar="ALGO",
                        help=f"collective algorithm: {', '.join(COLLECTIVES)} (default ring)")
    parser.add_argument("--ranks", type=int, default=None, metavar="N",
                        help="NPUs to simulate (default: the traced ranks; more are scaled from the traced ones)")
    parser.add_argument("--assume-data-parallel", action="store_true",
                        help="with --ranks above the traced ranks: scale a run that has no run.json, or whose "
                        "collectives do not look data-parallel, anyway (as scale_et.py does)")
    parser.add_argument("--astra-sim", default=None, metavar="PATH",
                        help=f"the {BINARY_NAME} binary (default: ${ASTRA_SIM_ENV})")
    parser.add_argument("--no-cpu-bound", action="store_true",
                        help="on a CPU run, do not simulate again without the communication threads' CPU time (the "
                        "step's bound on a network faster than the traced one; it doubles ASTRA-sim's time)")
    parser.add_argument("--no-wake-cost", action="store_true",
                        help="on a CPU run, simulate the training thread's compute as traced, with the cost of the "
                        "traced network's pauses, instead of giving it the cost of the simulated network's "
                        "(trace_tools.wake_cost)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    invocation = shlex.join(["python3", "simulate.py", *(sys.argv[1:] if argv is None else argv)])
    with StopSignal() as stop:  # SIGTERM unwinds as Ctrl-C does, so ASTRA-sim is stopped too
        try:
            return _main(args, invocation)
        except InterruptedAfterWriting as e:  # it had said "not written" of a file it had just written
            print(f"interrupted: simulate.py stopped by {stop.name} once the simulation was done and written to "
                  f"{e.written}", file=sys.stderr)
            return stop.exit_code
        except KeyboardInterrupt:
            print(f"interrupted: simulate.py stopped by {stop.name}; ASTRA-sim was stopped and {SIMULATION_FILE} not "
                  "written", file=sys.stderr)
            return stop.exit_code
        except BrokenPipeError:  # `2>&1 | head` while ASTRA-sim ran: stopped with it, nothing written
            output_closed()
            return 1


def _main(args: argparse.Namespace, invocation: str) -> int:
    try:
        bandwidth = parse_bandwidth(args.bandwidth)
        Network(args.ranks or 2, bandwidth, args.latency, args.topology, args.collective)  # flags checked first
        find_workload(Path(args.run))  # then the run: a folder that is not there is named before ASTRA-sim is sought
        binary = find_astra_sim(args.astra_sim)
        result = simulate_run(Path(args.run), ranks=args.ranks, bandwidth_gbs=bandwidth, latency_ns=args.latency,
                              topology=args.topology, collective=args.collective, binary=binary,
                              communication_cpu_bound=not args.no_cpu_bound, wake_cost=not args.no_wake_cost,
                              assume_data_parallel=args.assume_data_parallel, invocation=invocation,
                              progress=lambda line: print(line, file=sys.stderr, flush=True))
    except SimulationError as e:
        print(f"error: {e}", file=sys.stderr)
        # A bad flag or $ASTRA_SIM is the user's setting (a usage error); anything else is the run's or ASTRA-sim's
        usage = e.usage if e.usage is not None else str(e).startswith(("--", f"${ASTRA_SIM_ENV} "))
        return 2 if usage else 1
    except OSError as e:  # a folder that cannot be written (read-only, full, a file in the way)
        print(f"error: {e.filename or args.run}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        print_result(result)
    except BrokenPipeError:  # `| head`: SIMULATION.md is written whole all the same
        output_closed()
    return 0


def print_result(result: SimulationResult) -> None:
    print(f"network: {result.network.describe()}")
    print(f"measured: {result.measured_source}")
    for note in [*result.scale_notes, result.network.caveat()]:
        if note:
            print(f"note: {note}")
    print(render_table(result))
    print(f"predicted step: {result.step_ms:,.1f} ms")
    if result.without_communication_cpu_ms is not None:
        print(bound_line(result))
    if result.wake and result.wake.ranks:
        print(result.wake.line())
    print(f"simulation: {result.simulation_file}")
