"""Whether a run's ranks come from one traced run: the tracer's run id, else what the traces themselves say."""
from __future__ import annotations

import datetime
import re
import statistics
from collections import Counter
from typing import Any

from .layout import RUN_METADATA_KEY

_RUN_RE = re.compile(rb'"' + RUN_METADATA_KEY.encode() + rb'"\s*:\s*(\{[^{}]*\})')
_HOST_NAME_RE = re.compile(rb'"host_name"\s*:\s*"([^"\\]{0,256})"')
# The metadata Kineto writes comes before "traceEvents"; a tool that rewrote the file may have put it at the end.
HEADER_BYTES = 1 << 16
# Ranks of one job run their traced step together (collectives hold them within a step of each other). Beyond this,
# on one machine (one clock), or this between machines (clocks may be off), they are two captures.
SAME_HOST_SLACK_S = 5.0
OTHER_HOST_SLACK_S = 600.0


def device_header_identity(data: bytes) -> dict[str, Any]:
    """The tracer's run identity and the machine's name, from the head of a Kineto trace (empty when absent)."""
    import orjson

    head = data[:HEADER_BYTES] + b"\n" + data[-HEADER_BYTES:]
    found: dict[str, Any] = {}
    match = _RUN_RE.search(head)
    if match:
        try:
            run = orjson.loads(match.group(1))
        except orjson.JSONDecodeError:
            run = None
        if isinstance(run, dict):
            found["run_id"] = str(run.get("id")) if run.get("id") is not None else None
            for key in ("rank", "world_size"):
                if isinstance(run.get(key), int):
                    found[f"run_{key}"] = run[key]
    match = _HOST_NAME_RE.search(head)
    if match:
        found["host_name"] = match.group(1).decode("utf-8", "replace")
    return found


def rank_identity(host, device, header: dict[str, Any], step_start_us: float, step_us: float) -> dict[str, Any]:
    """What one rank's traces say about the run they belong to (host = HostTrace, device = DeviceTrace)."""
    distributed = device.distributed if isinstance(device.distributed, dict) else {}
    identity: dict[str, Any] = {
        "run_id": header.get("run_id"),
        "host_name": header.get("host_name"),
        "host_pid": host.pid if isinstance(host.pid, int) else None,
        "host_time": host.time or None,
        "dist_rank": distributed.get("rank") if isinstance(distributed.get("rank"), int) else header.get("run_rank"),
        "world_size": (distributed.get("world_size") if isinstance(distributed.get("world_size"), int)
                       else header.get("run_world_size")),
        "process_groups": _process_groups(host.process_groups or distributed.get("pg_config") or []),
        "step_us": step_us,
        "step_start_unix_us": None,
    }
    if device.base_time_ns is not None:
        # Kineto's timestamps are microseconds after baseTimeNanoseconds (wall clock).
        identity["step_start_unix_us"] = device.base_time_ns / 1000 + step_start_us
    return identity


def _process_groups(groups: list) -> dict[str, list]:
    """Process group name -> [size, ranks] (the default group is "0"; the observer leaves its ranks empty)."""
    found = {}
    for group in groups:
        if not isinstance(group, dict):
            continue
        ranks = [r for r in group.get("ranks") or [] if isinstance(r, int)]
        size = group.get("group_size", group.get("pg_size"))
        found[str(group.get("pg_name", ""))] = [size if isinstance(size, int) else len(ranks), ranks]
    return found


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"
    if seconds >= 60:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{seconds:.1f} s"


def _odd_ones(values: dict[int, Any]) -> tuple[Any, list[int]]:
    """The value most ranks share (ties: the lowest rank's) and the ranks that differ from it."""
    counts = Counter(values.values())
    best = max(counts.values())
    common = next(v for _, v in sorted(values.items()) if counts[v] == best)
    return common, sorted(r for r, v in values.items() if v != common)


def one_run_problems(identities: dict[int, dict[str, Any]], run_info_id: str | None = None,
                     ranks_with_files: list[int] | None = None) -> list[str]:
    """Why these ranks cannot be one run, each problem in one line naming the odd rank (empty when they can).

    identities: rank -> rank_identity() of every converted rank; run_info_id: the run id in run.json, if any;
    ranks_with_files: every rank the folder has traces of, converted or not (default: those of identities), against
    the world the traces were recorded in.
    """
    problems: list[str] = []
    ranks = sorted(identities)
    run_ids = {r: identities[r].get("run_id") for r in ranks}
    with_id = {r: v for r, v in run_ids.items() if v}
    if with_id:
        common, odd = _odd_ones(run_ids)
        if common is None:  # most ranks carry no run id: those that do are the odd ones
            odd = sorted(with_id)
        for r in odd:
            if run_ids[r]:
                problems.append(f"rank {r} comes from traced run {run_ids[r]} but {_ranks_text(_others(run_ids, r))} "
                                f"from {common or 'a capture without a run id'}: the files come from different runs")
            else:
                problems.append(f"rank {r} carries no run id while {_ranks_text(sorted(with_id))} come from traced "
                                f"run {common}: the files come from different runs")
        if run_info_id and not odd and common and run_info_id != common:
            problems.append(f"run.json belongs to traced run {run_info_id} but the traces to run {common}: run.json "
                            "is left from another run (trace again, or remove run.json)")
    for r in ranks:
        said = identities[r].get("dist_rank")
        if isinstance(said, int) and said != r:
            problems.append(f"rank {r}'s device trace was recorded by rank {said} (its distributedInfo): the files "
                            f"of rank {said} were copied as rank {r}'s")
    worlds = {r: identities[r].get("world_size") or 1 for r in ranks}
    present = sorted(set(ranks_with_files if ranks_with_files is not None else ranks))
    world = _odd_ones(worlds)[0] if ranks else 1
    absent = [r for r in range(world) if r not in present] if isinstance(world, int) else []
    if absent and not problems:
        problems.append(f"the traces were recorded in a world of {world} ranks but rank(s) {', '.join(map(str, absent))} "
                        f"have no host and device trace here: copy every rank's files (a part of a run would be "
                        "simulated as a smaller run)")
    if len(ranks) < 2:
        return problems
    if any(identities[r].get("world_size") for r in ranks):
        common, odd = _odd_ones(worlds)
        for r in odd:
            alone = "alone (no process group)" if worlds[r] == 1 else f"in a world of {worlds[r]} ranks"
            problems.append(f"rank {r} was traced {alone} but {_ranks_text(_others(worlds, r))} in a world of "
                            f"{common}: the files come from different runs")
        if not odd and common != 1 and max(ranks) >= common:
            problems.append(f"the traces say the world has {common} ranks, but there are files for "
                            f"{_ranks_text([r for r in ranks if r >= common])}: the files come from different runs")
    processes = {}
    for r in ranks:
        key = (identities[r].get("host_name"), identities[r].get("host_pid"))
        if key[1] is not None and key in processes:
            problems.append(f"rank {r} and rank {processes[key]} were traced by the same process (pid {key[1]}): "
                            f"the files of one rank were copied as another's")
        processes.setdefault(key, r)
    problems += _process_group_problems(identities, ranks)
    problems += _start_time_problems(identities, ranks)
    return problems


def _others(values: dict[int, Any], rank: int) -> list[int]:
    return sorted(r for r, v in values.items() if v != values[rank])


def _process_group_problems(identities: dict[int, dict[str, Any]], ranks: list[int]) -> list[str]:
    """A process group of one name with different members on two ranks (groups a rank is not in may be absent)."""
    seen: dict[str, tuple[int, list]] = {}
    problems = []
    for r in ranks:
        for name, (size, members) in sorted((identities[r].get("process_groups") or {}).items()):
            if name in seen:
                first, (first_size, first_members) = seen[name]
                if size != first_size or (members and first_members and members != first_members):
                    problems.append(f"process group {name!r} has {_group(first_size, first_members)} on rank {first} "
                                    f"but {_group(size, members)} on rank {r}: the files come from different runs")
                    break
            seen.setdefault(name, (r, [size, members]))
    return problems


def _group(size: int, members: list[int]) -> str:
    return f"{size} ranks" + (f" {members}" if members else "")


def _start_time_problems(identities: dict[int, dict[str, Any]], ranks: list[int]) -> list[str]:
    """Ranks whose traced step ran far from the others' (the wall clock of the step, else the host trace's start)."""
    starts = {r: identities[r]["step_start_unix_us"] / 1e6 for r in ranks
              if isinstance(identities[r].get("step_start_unix_us"), (int, float))}
    step_s = max((identities[r].get("step_us") or 0) / 1e6 for r in ranks)
    if len(starts) < len(ranks):
        starts = {r: t for r in ranks if (t := _host_time(identities[r].get("host_time"))) is not None}
        step_s = 60.0  # the host trace starts with the profiler's warm-up, and its time has whole seconds
    if len(starts) < 2:
        return []
    middle = statistics.median_low(starts.values())
    reference = min(r for r, t in starts.items() if t == middle)
    hosts = {identities[r].get("host_name") for r in ranks}
    slack = SAME_HOST_SLACK_S if len(hosts) == 1 and None not in hosts else OTHER_HOST_SLACK_S
    problems = []
    for r, t in sorted(starts.items()):
        gap = t - starts[reference]
        if abs(gap) > 2 * step_s + slack:
            when = "after" if gap > 0 else "before"
            problems.append(f"rank {r}'s traced step ran {_duration(abs(gap))} {when} rank {reference}'s: two "
                            f"captures, the files come from different runs")
    return problems


def _host_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S").timestamp()
    except ValueError:
        return None


# The host trace's "time" is the observer's start in the tracing machine's local time, to the second, without a
# zone; the device trace's window starts at baseTimeNanoseconds + its first timestamp (UTC). Zones are whole
# quarter hours from UTC-12 to UTC+14; the observer starts with the profiler's active window (ours) or, in
# hand-made captures, up to a few minutes before it.
ZONE_STEP_S = 900
ZONES_S = range(-12 * 3600, 14 * 3600 + 1, ZONE_STEP_S)
OBSERVER_LEAD_S = (-2.0, 300.0)
PLAUSIBLE_UNIX_S = (1.42e9, 4.1e9)  # 2015 .. 2100: outside it the device clock is not a wall clock


def host_device_time_problem(host_time: Any, device_start_unix_s: float | None) -> str | None:
    """Why a host trace cannot have been captured with this device trace, judged by their start times (None when
    they fit, or when either time is missing): a host file of another capture with the same pid passes every
    other check."""
    if not isinstance(host_time, str) or device_start_unix_s is None:
        return None
    try:
        clock = datetime.datetime.strptime(host_time, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    host_s = clock.replace(tzinfo=datetime.timezone.utc).timestamp()
    if not PLAUSIBLE_UNIX_S[0] < device_start_unix_s < PLAUSIBLE_UNIX_S[1]:
        return None
    # host_s reads the local clock as UTC: host_s = utc_start + zone, so lead = device start - (host_s - zone).
    lead = device_start_unix_s - host_s
    low, high = OBSERVER_LEAD_S
    if any(low <= lead + zone <= high for zone in ZONES_S):
        return None
    device_utc = datetime.datetime.fromtimestamp(device_start_unix_s, datetime.timezone.utc)
    return (f"its capture started at {host_time} (the tracing machine's clock), but the device trace's window at "
            f"{device_utc:%Y-%m-%d %H:%M:%S} UTC, which no time zone explains: the host trace comes from another "
            "capture (same process id, other run); copy the host and device trace of one capture")
