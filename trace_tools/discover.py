"""Find trace runs: tracer folders (host.<rank>.json + device.<rank>.json), the seed's flat files, or their parents."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from .layout import RUN_INFO, TRACE_FILE_RE, device_trace_name, host_trace_name
from .load import json_kind
from .wake_cost import WakeCost

# <name>_host.json, <name>_device.json.gz, <name>_host.1.json, <name>_host_rank1.json (the seed's flat layout)
FLAT_FILE = re.compile(r"^(?P<name>.+?)_(?P<kind>host|device)(?:[._](?:rank)?(?P<rank>\d+))?\.json(?:\.gz)?$")


@dataclass
class Run:
    """One traced run: its name (the .et prefix), where it lives, and each rank's host and device file."""

    name: str
    folder: Path
    hosts: dict[int, Path] = field(default_factory=dict)
    devices: dict[int, Path] = field(default_factory=dict)
    world_size: int | None = None
    run_id: str | None = None  # the tracer's run id in run.json (each device trace carries it too)
    run_info_problem: str | None = None  # why run.json beside the traces cannot be read (None: fine, or none there)
    passed_over: list[Path] = field(default_factory=list)  # x.json.gz beside the x.json converted in its place

    @property
    def ranks(self) -> list[int]:
        expected = set(range(self.world_size)) if self.world_size else set()
        present = set(self.hosts) | set(self.devices)
        if present:
            expected |= set(range(max(present) + 1))
        return sorted(expected | present)

    def missing(self, rank: int) -> str | None:
        """Why a rank cannot be converted because of absent files, or a folder in a file's place (None when both
        files are there)."""
        host, device = self.hosts.get(rank), self.devices.get(rank)
        if host and device:
            return None
        problem = self.folder_in_place(rank, "host") or self.folder_in_place(rank, "device")
        if problem:
            return problem
        if not host and not device:
            return (f"{self.expected(rank, 'host')}: missing, and {self.expected(rank, 'device')} too "
                    f"(the run has ranks {', '.join(str(r) for r in sorted(set(self.hosts) | set(self.devices)))})")
        if not host:
            return f"{self.expected(rank, 'host')}: missing (its device trace {device.name} is there)"
        return f"{self.expected(rank, 'device')}: missing (its host trace {host.name} is there)"

    def folder_in_place(self, rank: int, kind: str) -> str | None:
        """Why the rank's `kind` ("host" or "device") trace cannot be read when a folder is where its file belongs (a
        copy gone wrong), which discovery passes over as no file; None when there is no such folder, or the file."""
        if (self.hosts if kind == "host" else self.devices).get(rank):
            return None
        expected = self.expected(rank, kind)
        folder = next((path for path in (expected, expected.with_name(expected.name + ".gz")) if path.is_dir()), None)
        return f"{folder}: is a directory, expected a {kind} trace file" if folder else None

    def expected(self, rank: int, kind: str) -> Path:
        """The file a rank's trace would have, in the layout this run uses."""
        present = next(iter(self.hosts.values()), None) or next(iter(self.devices.values()), None)
        if present is not None and FLAT_FILE.match(present.name) and not TRACE_FILE_RE.match(present.name):
            return self.folder / (f"{self.name}_{kind}.json" if rank == 0 else f"{self.name}_{kind}.{rank}.json")
        return self.folder / (host_trace_name(rank) if kind == "host" else device_trace_name(rank))


def _prefer(run: Run, existing: Path | None, candidate: Path) -> Path:
    """Of x.json and x.json.gz, the uncompressed one (what `gunzip -k` leaves to be read or edited, and what older
    repairs wrote); the other is recorded in run.passed_over, so that the conversion says which one it read."""
    if existing is None:
        return candidate
    kept, other = (existing, candidate) if existing.suffix == ".json" else (candidate, existing)
    run.passed_over.append(other)
    return kept


def _is_file(path: Path) -> bool:
    """Whether path is a regular file; False for one that cannot be looked at (no permission), which a scan of a
    folder of runs passes over as it passes over any other non-trace."""
    try:
        return path.is_file()
    except OSError:
        return False


def subfolders(path: Path) -> list[Path]:
    """The visible folders in path, sorted; none when path cannot be listed or looked into (no permission)."""
    try:
        return sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_dir())
    except OSError:
        return []


def _scan_folder(folder: Path) -> list[Run]:
    tracer = Run(name=folder.resolve().name, folder=folder)
    flat: dict[str, Run] = {}
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return []
    for path in entries:
        if path.name.startswith(".") or not _is_file(path):
            continue
        match = TRACE_FILE_RE.match(path.name)
        if match:
            rank = int(match.group("rank"))
            table = tracer.hosts if match.group("kind") == "host" else tracer.devices
            table[rank] = _prefer(tracer, table.get(rank), path)
            continue
        match = FLAT_FILE.match(path.name)
        if match:
            run = flat.setdefault(match.group("name"), Run(name=match.group("name"), folder=folder))
            rank = int(match.group("rank") or 0)
            table = run.hosts if match.group("kind") == "host" else run.devices
            table[rank] = _prefer(run, table.get(rank), path)
    runs = []
    if tracer.hosts or tracer.devices:
        info = folder / RUN_INFO
        if info.exists() or info.is_symlink():  # a folder or a dangling link is a run.json that cannot be read
            facts, tracer.run_info_problem = read_run_info(info)
            if isinstance(facts, dict):
                world_size = facts.get("world_size")
                tracer.world_size = world_size if isinstance(world_size, int) and world_size > 0 else None
                tracer.run_id = str(facts["run_id"]) if facts.get("run_id") else None
        runs.append(tracer)
    runs.extend(flat[name] for name in sorted(flat))
    return runs


def read_run_info(path: Path) -> tuple[dict | None, str | None]:
    """run.json's content, or None and why it cannot be used: the tracer writes it whole (temporary file, then
    rename), so a file cut short or not an object is a broken copy, and converting without it would silently drop
    the step times the .et durations are corrected with."""
    try:
        facts = json.loads(path.read_bytes())
    except OSError as e:
        return None, f"{path}: cannot be read ({e.strerror or e})"
    except ValueError as e:
        where = f" at byte {e.pos}" if isinstance(getattr(e, "pos", None), int) else ""
        return None, (f"{path}: not valid JSON{where} ({getattr(e, 'msg', e)}): a broken copy of the tracer's file; "
                      "copy it again from the run, or remove it to convert without the run's step times")
    if not isinstance(facts, dict):
        return None, f"{path}: not a run description ({json_kind(facts)}, not an object)"
    problem = _measurement_problem(facts)
    if problem:
        return None, (f"{path}: {problem}: a damaged copy of the tracer's file, which never holds such a value; "
                      "copy it again from the run, or remove it to convert without the run's step times")
    return facts, None


def _measurement_problem(facts: dict) -> str | None:
    """The first value of run.json's measurements that no tracer writes (None when all can be): the .et durations
    are scaled to these times, so a negative, non-finite or non-numeric one would give a wrong .et, not an error.
    Each rank's step lists (step_* and untraced_step_*, StepMeasures.report) hold non-negative finite numbers, wall
    times and micro-batch counts above zero; the step numbers are non-negative integers."""
    for key in ("world_size", "ranks_gathered"):
        if key in facts and not _is_count(facts[key], minimum=1):
            return f"{key} is {facts[key]!r}, not a positive whole number"
    for key in ("traced_steps", "untraced_steps"):
        if key in facts and not (isinstance(facts[key], list) and all(_is_count(n) for n in facts[key])):
            return f"{key} is {_shown(facts[key])}, not a list of step numbers"
    problem = _times_problem("step_wall_time_s_max", facts.get("step_wall_time_s_max"))
    if problem:
        return problem
    ranks = facts.get("ranks", [])
    if not isinstance(ranks, list):
        return f"ranks is {_shown(ranks)}, not a list of the ranks' measurements"
    for index, entry in enumerate(ranks):
        if not isinstance(entry, dict) or not _is_count(entry.get("rank")):
            return f"ranks[{index}] is {_shown(entry)}, not a rank's measurements with its rank number"
        for key, value in entry.items():
            if key.startswith(("step_", "untraced_step_")):
                problem = _times_problem(f"ranks[{index}].{key}", value)
            elif key in ("recording_cost_per_op_us", "collective_start_wait_s") and value is not None:
                problem = None if _is_amount(value) else f"ranks[{index}].{key} is {_shown(value)}, not a number >= 0"
            elif key == "wake_cost" and value is not None:
                problem = (None if WakeCost.from_run_info(value) else f"ranks[{index}].wake_cost is {_shown(value)}, "
                           "not the tracer's measurement (pauses_s, compute_s and extra_cpu_s, utils/wake_cost.py)")
            else:
                continue
            if problem:
                return problem
    return None


def _times_problem(where: str, values) -> str | None:
    """Why a step list of run.json is not one the tracer writes (None: it is one, or it is absent)."""
    if values is None:
        return None
    if not isinstance(values, list):
        return f"{where} is {_shown(values)}, not a list with a value a step"
    counts = where.endswith(("micro_batches", "page_faults"))
    positive = where.endswith(("wall_time_s", "wall_time_s_max", "micro_batches"))
    for i, value in enumerate(values):
        if counts and not _is_count(value, minimum=1 if positive else 0):
            return f"{where}[{i}] is {_shown(value)}, not a whole number{' above 0' if positive else ' >= 0'}"
        if not counts and not (_is_amount(value) and (value > 0 or not positive)):
            return f"{where}[{i}] is {_shown(value)}, not a time in seconds{' above 0' if positive else ' >= 0'}"
    return None


def _is_count(value, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_amount(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _shown(value) -> str:
    """A JSON value as the file holds it, cut to one short line."""
    text = json.dumps(value, allow_nan=True)
    return text if len(text) <= 60 else text[:57] + "..."


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Runs in the given folders or files: a run folder, a folder of run folders (searched two levels deep), or
    trace files named directly (grouped into their runs)."""
    runs: list[Run] = []
    seen: set[tuple[Path, str]] = set()

    def add(found: list[Run]) -> None:
        for run in found:
            key = (run.folder.resolve(), run.name)
            if key not in seen:
                seen.add(key)
                runs.append(run)

    for raw in paths:
        path = Path(raw)
        if path.is_file():
            folder_runs = _scan_folder(path.parent)
            add([run for run in folder_runs if path in run.hosts.values() or path in run.devices.values()])
            continue
        if not path.is_dir():
            continue
        here = _scan_folder(path)
        add(here)
        if here:
            continue
        for child in subfolders(path):
            found = _scan_folder(child)
            if not found:
                for grandchild in subfolders(child):
                    add(_scan_folder(grandchild))
            add(found)
    return runs
