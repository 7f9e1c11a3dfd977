"""Find trace runs: tracer folders (host.<rank>.json + device.<rank>.json), the seed's flat files, or their parents."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .layout import RUN_INFO, TRACE_FILE_RE, device_trace_name, host_trace_name

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

    @property
    def ranks(self) -> list[int]:
        expected = set(range(self.world_size)) if self.world_size else set()
        present = set(self.hosts) | set(self.devices)
        if present:
            expected |= set(range(max(present) + 1))
        return sorted(expected | present)

    def missing(self, rank: int) -> str | None:
        """Why a rank cannot be converted because of absent files (None when both are there)."""
        host, device = self.hosts.get(rank), self.devices.get(rank)
        if host and device:
            return None
        if not host and not device:
            return (f"{self.expected(rank, 'host')}: missing, and {self.expected(rank, 'device')} too "
                    f"(the run has ranks {', '.join(str(r) for r in sorted(set(self.hosts) | set(self.devices)))})")
        if not host:
            return f"{self.expected(rank, 'host')}: missing (its device trace {device.name} is there)"
        return f"{self.expected(rank, 'device')}: missing (its host trace {host.name} is there)"

    def expected(self, rank: int, kind: str) -> Path:
        """The file a rank's trace would have, in the layout this run uses."""
        present = next(iter(self.hosts.values()), None) or next(iter(self.devices.values()), None)
        if present is not None and FLAT_FILE.match(present.name) and not TRACE_FILE_RE.match(present.name):
            return self.folder / (f"{self.name}_{kind}.json" if rank == 0 else f"{self.name}_{kind}.{rank}.json")
        return self.folder / (host_trace_name(rank) if kind == "host" else device_trace_name(rank))


def _prefer(existing: Path | None, candidate: Path) -> Path:
    # Both x.json and x.json.gz: the uncompressed one is the one a repair may have rewritten.
    if existing is None:
        return candidate
    return existing if existing.suffix == ".json" else candidate


def _scan_folder(folder: Path) -> list[Run]:
    tracer = Run(name=folder.resolve().name, folder=folder)
    flat: dict[str, Run] = {}
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return []
    for path in entries:
        if not path.is_file() or path.name.startswith("."):
            continue
        match = TRACE_FILE_RE.match(path.name)
        if match:
            rank = int(match.group("rank"))
            table = tracer.hosts if match.group("kind") == "host" else tracer.devices
            table[rank] = _prefer(table.get(rank), path)
            continue
        match = FLAT_FILE.match(path.name)
        if match:
            run = flat.setdefault(match.group("name"), Run(name=match.group("name"), folder=folder))
            rank = int(match.group("rank") or 0)
            table = run.hosts if match.group("kind") == "host" else run.devices
            table[rank] = _prefer(table.get(rank), path)
    runs = []
    if tracer.hosts or tracer.devices:
        info = folder / RUN_INFO
        if info.is_file():
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
        return None, f"{path}: not a run description (a JSON {type(facts).__name__}, not an object)"
    return facts, None


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
        for child in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
            found = _scan_folder(child)
            if not found:
                for grandchild in sorted(p for p in child.iterdir() if p.is_dir() and not p.name.startswith(".")):
                    add(_scan_folder(grandchild))
            add(found)
    return runs
