"""The file layout and names of a traced run, shared by the tracer, discovery, loading, the launchers and the docs'
tests (torch-free). One folder per run: <trace-output-dir>/<trace-name>/ holding, per rank, host.<r>.json (PyTorch's
ExecutionTraceObserver), device.<r>.json (Kineto), stacks.<r>.txt, and run.json; the converter adds
<trace-name>.<r>.et and CONVERSION_SUMMARY.md."""
import re
from pathlib import Path

HOST_TRACE = "host.{rank}.json"
DEVICE_TRACE = "device.{rank}.json"
# host.0.json, device.1.json.gz: a rank's traces as discovery recognises them (gzipped by hand or by a copy)
TRACE_FILE_RE = re.compile(r"^(?P<kind>host|device)\.(?P<rank>\d+)\.json(?:\.gz)?$")
STACKS_TABLE = "stacks.{rank}.txt"
RUN_INFO = "run.json"
ET_FILE = "{prefix}.{rank}.et"  # the name ASTRA-sim reads: <workload prefix>.<rank>.et
ET_FILE_RE = re.compile(r"^(?P<name>[^.].*)\.(?P<rank>\d+)\.et$")  # hidden files are partial ones
CONVERSION_SUMMARY = "CONVERSION_SUMMARY.md"
# Written here first and renamed once complete and valid, so a crash never leaves a half-written trace.
PARTIAL_SUFFIX = ".partial"
INVALID_SUFFIX = ".invalid"
# The profiler marks optimizer step n in both traces with this annotation.
STEP_PREFIX = "ProfilerStep#"
STEP_ANNOTATION = STEP_PREFIX + "{step}"
# Every device trace carries the run's identity in its metadata under this key: {"id", "rank", "world_size"}.
RUN_METADATA_KEY = "mosim_run"
# The files of the run a new one replaces go here, once the new window is written: <trace-output-dir>/.previous/<name>/
PREVIOUS_RUN_DIR = ".previous"
# What trace_report.py and simulate.py write beside a run's .et files: they describe those .et files, so a conversion
# that rewrites one removes them.
REPORT_FILE_RE = re.compile(r"report\.(md|json)|report_(breakdown|top_ops|collectives|timeline_rank\d+)\.png")
SIMULATION_FILE = "SIMULATION.md"
SIMULATION_WORK_DIR = "astra-sim"  # simulate.py's: the network and system files it wrote, ASTRA-sim's output and logs
SIMULATION_FAILED_DIR = SIMULATION_WORK_DIR + ".failed"  # simulate.py's files of a simulation ASTRA-sim failed
# What a conversion made of a run's traces, besides its .et files (with the files above, rank 0's tracer moves them
# aside with the traces they came from).
DERIVED_FILES = (RUN_INFO, CONVERSION_SUMMARY)
# ExecutionTraceObserver.start() records the process-group config under this name when torch.distributed is up.
PG_INIT_NODE = "## process_group:init ##"


def made_from_et_files(name: str) -> bool:
    """Whether a file of this name in a converted run's folder describes its .et files (a report, a simulation and
    its folder)."""
    return name in (SIMULATION_FILE, SIMULATION_WORK_DIR, SIMULATION_FAILED_DIR) or \
        REPORT_FILE_RE.fullmatch(name) is not None


def derived_file(name: str) -> bool:
    """Whether a file of this name in a run's folder was made from its traces (not a trace itself)."""
    return name in DERIVED_FILES or made_from_et_files(name)


def host_trace_name(rank: int) -> str:
    return HOST_TRACE.format(rank=rank)


def device_trace_name(rank: int) -> str:
    return DEVICE_TRACE.format(rank=rank)


def et_name(prefix: str, rank: int) -> str:
    return ET_FILE.format(prefix=prefix, rank=rank)


def et_sets(folder: str | Path) -> dict[str, dict[int, Path]]:
    """The .et sets in a folder: workload prefix name -> {rank: path} (empty when the folder cannot be read)."""
    sets: dict[str, dict[int, Path]] = {}
    try:
        entries = sorted(Path(folder).iterdir())
    except OSError:
        return sets
    for path in entries:
        match = ET_FILE_RE.match(path.name)
        if match and path.is_file():
            sets.setdefault(match["name"], {})[int(match["rank"])] = path
    return sets


def ranks_sharing_a_file(et_files: dict[int, Path]) -> dict[int, list[int]]:
    """The ranks of each distinct file, under the lowest of them: the ranks of a set scale_et.py wrote that replay
    one traced rank are hard links to one file, which scale_et.py and trace_report.py read once (a report of a
    1024-rank set had taken 198 s and drawn 1024 timelines of 2 files). A file that cannot be stat'ed is its rank's
    own: reading it names the problem."""
    groups: dict[int, list[int]] = {}
    first_of: dict[tuple[int, int], int] = {}
    for rank, path in sorted(et_files.items()):
        try:
            stat = path.stat()
            key = (stat.st_dev, stat.st_ino)
        except OSError:
            key = (-1, -1 - rank)
        groups.setdefault(first_of.setdefault(key, rank), []).append(rank)
    return groups
