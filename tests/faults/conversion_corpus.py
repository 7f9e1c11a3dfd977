"""Fault corpus of the conversion side: each case breaks the bundled traces one way, runs the real commands and
says how they answered.

Every case is built by code from tests/data/cpu (nothing large is committed), run through the scripts a user runs
(convert_to_et.py, convert_remaining.py, fix_host_traces.py, and the tracer for the cases about re-tracing), and
classified as one of:

- ``clear``: a one-line ``error:`` (or ``warning:``) that says what is wrong where, or a correct result;
- ``misleading``: a one-line error that blames the wrong thing (or tool answers that contradict each other);
- ``traceback``: a raw Python traceback or an "internal error";
- ``wrong_ok``: a wrong or unusable result presented as usable (exit 0, a ✅, or .et files left that look good);
- ``lost``: data or finished work lost (previous traces deleted, converted ranks redone after Ctrl-C).

``python tests/faults/conversion_corpus.py`` prints one line per case and the counts; ``run_cases()`` returns
``[{"case", "outcome", "message"}]`` (tests/faults/training_corpus.py has the same interface for the training side).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
CPU = REPO / "tests" / "data" / "cpu"
GPT2_1R, GPT2_2R, BERT_2R = CPU / "gpt2_tiny_1r", CPU / "gpt2_tiny_2r", CPU / "bert_tiny_2r"
GPT2_BUCKETS = CPU / "gpt2_2x128_2r_buckets"  # three traced steps, a 2-layer GPT-2 of two DDP buckets
OUTCOMES = ("clear", "misleading", "traceback", "wrong_ok", "lost")
TRACEBACK_MARKS = ("Traceback (most recent call last)", "internal error")


# ---- running the tools ------------------------------------------------------------------------------------------
@dataclass
class Proc:
    rc: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.text.splitlines() if line.startswith(prefix)]


def run(script: str, *args, timeout: int = 300, preexec: Callable | None = None, cwd: Path = REPO) -> Proc:
    proc = subprocess.run([sys.executable, str(REPO / script), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, preexec_fn=preexec)
    return Proc(proc.returncode, proc.stdout, proc.stderr)


def convert(*args, **kw) -> Proc:
    return run("convert_to_et.py", *args, "--no-progress", **kw)


def remaining(*args, **kw) -> Proc:
    return run("convert_remaining.py", *args, "--no-progress", **kw)


def fix(*args, **kw) -> Proc:
    return run("fix_host_traces.py", *args, **kw)


def interrupt_when(script: str, args: list, ready: Callable[[], bool], timeout: float = 120,
                   signum: int = signal.SIGINT) -> Proc:
    """Run script in its own process group and press Ctrl-C (SIGINT to the group, as a terminal does; or send
    `signum`) once ready() is true."""
    # preexec_fn: Ctrl-C acts as in a terminal even when the tests run as a background job (SIGINT inherited ignored)
    proc = subprocess.Popen([sys.executable, str(REPO / script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not ready() and time.monotonic() < deadline:
        time.sleep(0.02)
    if proc.poll() is None:
        os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=timeout)
    return Proc(proc.returncode, out, err)


# ---- classifying -------------------------------------------------------------------------------------------------
def _traceback(proc: Proc) -> tuple[str, str] | None:
    if any(mark in proc.text for mark in TRACEBACK_MARKS):
        lines = [line for line in proc.text.splitlines() if line.strip()]
        marked = [line for line in lines if "internal error" in line]
        return "traceback", (marked or lines or [""])[-1]
    return None


def expect_error(proc: Proc, *keywords: str, forbidden: tuple[str, ...] = ()) -> tuple[str, str]:
    """The tool must fail with one-line errors that hold every keyword (case-insensitive) and none of `forbidden`."""
    tb = _traceback(proc)
    if tb:
        return tb
    errors = proc.lines("error:")
    if proc.rc == 0:
        return "wrong_ok", "exit 0" + (f": {errors[0]}" if errors else "")
    if not errors:
        return "misleading", f"exit {proc.rc} without an error line: {proc.text.strip()[-200:]}"
    joined = " ".join(errors).lower()
    if all(k.lower() in joined for k in keywords) and not any(f.lower() in joined for f in forbidden):
        return "clear", errors[0]
    return "misleading", errors[0]


def expect_ok(proc: Proc, *keywords: str) -> tuple[str, str]:
    tb = _traceback(proc)
    if tb:
        return tb
    if proc.rc != 0:
        return "misleading", (proc.lines("error:") or [f"exit {proc.rc}"])[0]
    missing = [k for k in keywords if k.lower() not in proc.text.lower()]
    if missing:
        return "wrong_ok", f"ok, but the output does not say {missing[0]!r}"
    return "clear", "ok"


def expect_warning(proc: Proc, *keywords: str) -> tuple[str, str]:
    """Converted, with a console warning holding every keyword."""
    tb = _traceback(proc)
    if tb:
        return tb
    warnings = proc.lines("warning:")
    joined = " ".join(warnings).lower()
    if warnings and all(k.lower() in joined for k in keywords):
        return "clear", warnings[0]
    if proc.rc == 0:
        return "wrong_ok", "converted without a console warning"
    return "misleading", (proc.lines("error:") or [f"exit {proc.rc}"])[0]


def et_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.et"))


# ---- building inputs ---------------------------------------------------------------------------------------------
def unzip(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def load(path: Path) -> dict:
    return json.loads(unzip(path))


def dump(path: Path, document: dict) -> Path:
    path.write_text(json.dumps(document))
    return path


def copy_run(source: Path, folder: Path, ranks=None, plain: bool = True) -> Path:
    """The host and device traces of `source` (gunzipped when plain) in folder, as host.<r>.json / device.<r>.json."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.glob("*.json.gz")):
        kind, rank = path.name.split(".")[:2]
        if ranks is not None and int(rank) not in ranks:
            continue
        if plain:
            (folder / f"{kind}.{rank}.json").write_bytes(unzip(path))
        else:
            shutil.copyfile(path, folder / path.name)
    return folder


def place_rank(source: Path, rank_in_source: int, folder: Path, rank: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for kind in ("host", "device"):
        (folder / f"{kind}.{rank}.json").write_bytes(unzip(source / f"{kind}.{rank_in_source}.json.gz"))


def shift_capture(folder: Path, rank: int, hours: float, pid_offset: int) -> None:
    """Make rank's traces look like a second capture of the same config: other pid, `hours` later."""
    host_path, device_path = folder / f"host.{rank}.json", folder / f"device.{rank}.json"
    host, device = load(host_path), load(device_path)
    old_pid = host["pid"]
    host["pid"] = old_pid + pid_offset
    stamp = time.mktime(time.strptime(host["time"], "%Y-%m-%d %H:%M:%S")) + hours * 3600
    host["time"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
    device["baseTimeNanoseconds"] += int(hours * 3600 * 1e9)
    for event in device["traceEvents"]:
        if event.get("pid") == old_pid:
            event["pid"] = old_pid + pid_offset
    dump(host_path, host)
    dump(device_path, device)


def swap_in_host_of_second_capture(folder: Path, rank: int = 0) -> None:
    """host.<rank>.json as the same program wrote it in a second capture in the same container: same pid, same
    operators and rf_ids (so it links perfectly), only the observer's start time and clock readings differ (taken
    from bert_tiny_2r_ours, a second capture of bert_tiny_2r's config 2 h 9 min later)."""
    host = load(folder / f"host.{rank}.json")
    second = load(CPU / "bert_tiny_2r_ours" / f"host.{rank}.json.gz")
    for key in ("time", "start_ts", "finish_ts"):
        host[key] = second[key]
    dump(folder / f"host.{rank}.json", host)


def interleave(a: bytes, b: bytes, block: int = 8192) -> bytes:
    """Two processes writing one path, each from offset 0 with its own buffered writes: the file holds blocks of
    both, whichever was written last at each offset (here: alternating), as long as the longer one."""
    out = bytearray()
    for i in range(0, max(len(a), len(b)), block):
        source = a if (i // block) % 2 == 0 or i >= len(b) else b
        if i >= len(source):
            source = b if source is a else a
        out += source[i:i + block]
    return bytes(out)


def set_run_identity(folder: Path, rank: int, run_id: str, world_size: int) -> None:
    path = folder / f"device.{rank}.json"
    device = load(path)  # where the profiler writes its metadata: before traceEvents
    dump(path, {"mosim_run": {"id": run_id, "rank": rank, "world_size": world_size}, **device})


def host_with_more_steps(folder: Path) -> Path:
    """gpt2_tiny_1r made two steps long (the step repeated), with the device trace cut back to the first step."""
    sys.path.insert(0, str(REPO / "tests"))
    from conversion_helpers import read_json, scaled_trace

    host, device = scaled_trace(read_json(GPT2_1R / "host.0.json.gz"), read_json(GPT2_1R / "device.0.json.gz"), 2)
    steps = [e for e in device["traceEvents"] if e.get("ph") == "X" and str(e.get("name")).startswith("ProfilerStep#")]
    first = min(steps, key=lambda e: e["ts"])
    end = first["ts"] + first["dur"]
    device["traceEvents"] = [e for e in device["traceEvents"]
                             if not (e.get("ph") == "X" and isinstance(e.get("ts"), (int, float)) and e["ts"] > end)]
    folder.mkdir(parents=True, exist_ok=True)
    dump(folder / "host.0.json", host)
    dump(folder / "device.0.json", device)
    return folder


def limit_file_size(limit: int) -> Callable[[], None]:
    """preexec_fn: files may not grow beyond `limit` bytes (writes then fail with EFBIG, as on a full disk)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


TRACER_SCRIPT = """
import os, signal, sys
import torch
sys.path.insert(0, {repo!r})
from utils.chakra_tracer import ChakraTracer
out, name, steps, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
with ChakraTracer(out, name, wait_steps=1, warmup_steps=1, active_steps=1, run_info={{"model": "mlp"}}) as tracer:
    for step in range(steps):
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        tracer.step()
"""


def trace_mlp(work: Path, out: Path, name: str, steps: int = 4, kill_at: int = -1) -> Proc:
    script = work / "trace_mlp.py"
    script.write_text(TRACER_SCRIPT.format(repo=str(REPO)))
    proc = subprocess.run([sys.executable, str(script), str(out), name, str(steps), str(kill_at)],
                          capture_output=True, text=True, timeout=300, cwd=work,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    return Proc(proc.returncode, proc.stdout, proc.stderr)


# ---- the cases ---------------------------------------------------------------------------------------------------
CASES: dict[str, Callable[[Path], tuple[str, str]]] = {}


def case(function):
    CASES[function.__name__] = function
    return function


# Broken host traces
@case
def host_truncated(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    text = (folder / "host.0.json").read_bytes()
    (folder / "host.0.json").write_bytes(text[:len(text) * 3 // 5])
    return expect_error(convert(folder), "host.0.json", "truncated", "fix_host_traces")


@case
def host_truncated_inside_its_only_step_is_refused(work: Path):
    """A host trace cut short inside the one traced step lost the rest of that step, its all-reduce among it: the
    repair closes the node list, and the conversion refuses the rank (an .et of it would simulate no communication)
    rather than writing it."""
    folder = copy_run(GPT2_1R, work / "run")
    text = (folder / "host.0.json").read_bytes()
    (folder / "host.0.json").write_bytes(text[:len(text) * 3 // 5])
    repaired = fix(folder)
    if repaired.rc != 0:
        return expect_ok(repaired)
    proc = convert(folder)
    outcome = expect_error(proc, "host.0.json", "ends inside ProfilerStep#", "cut short")
    if outcome[0] == "clear" and et_files(folder):
        return "wrong_ok", f"refused, but left {et_files(folder)}"
    return outcome


@case
def host_truncated_repaired_is_flagged(work: Path):
    """A host trace cut short inside the last of three traced steps: the .et is made of the two whole ones, and the
    table, the summary, the .et's metadata and a warning say the host trace was repaired and the step left out."""
    folder = copy_run(GPT2_BUCKETS, work / "run")
    for rank in (0, 1):
        text = (folder / f"host.{rank}.json").read_bytes()
        (folder / f"host.{rank}.json").write_bytes(text[:len(text) * 9 // 10])
    repaired = fix(folder)
    if repaired.rc != 0:
        return expect_ok(repaired)
    proc = convert(folder)
    outcome = expect_warning(proc, "ends inside ProfilerStep#6", "that step is left out",
                             "made of ProfilerStep#4, ProfilerStep#5")
    if outcome[0] != "clear" or proc.rc != 0:
        return outcome if outcome[0] != "clear" else ("misleading", f"exit {proc.rc}")
    rows = [line for line in proc.out.splitlines() if line.split()[:2] == ["run", "0"]]
    if not rows or "repaired" not in rows[0]:
        return "wrong_ok", "the table shows a plain ok for a repaired host trace"
    summary = (folder / "CONVERSION_SUMMARY.md").read_text()
    if "host trace repaired" not in summary:
        return "wrong_ok", "CONVERSION_SUMMARY.md does not say the host trace was repaired"
    sys.path.insert(0, str(REPO))
    from trace_tools.validate import read_et
    metadata, _ = read_et(folder / "run.0.et")
    if not any(attr.name == "host_trace_repaired" for attr in metadata.attr):
        return "wrong_ok", "the .et metadata does not say the host trace was repaired"
    return "clear", rows[0]


@case
def host_concatenated(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    text = (folder / "host.0.json").read_bytes()
    (folder / "host.0.json").write_bytes(text + text)
    return expect_error(convert(folder), "concatenated", "fix_host_traces")


@case
def host_empty(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    (folder / "host.0.json").write_bytes(b"")
    return expect_error(convert(folder), "host.0.json", "empty")


@case
def host_nul_bytes_only(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    (folder / "host.0.json").write_bytes(b"\0" * 4096)
    return expect_error(convert(folder), "host.0.json")


@case
def host_single_node(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    host = load(folder / "host.0.json")
    host["nodes"] = host["nodes"][:1]
    dump(folder / "host.0.json", host)
    return expect_error(convert(folder), "host.0.json", "re-registered", "lost at capture")


@case
def host_two_ranks_one_path(work: Path):
    folder = work / "run"
    folder.mkdir()
    mixed = interleave(unzip(BERT_2R / "host.0.json.gz"), unzip(BERT_2R / "host.1.json.gz"))
    (folder / "bert_host.json").write_bytes(mixed)
    (folder / "bert_device.json").write_bytes(unzip(BERT_2R / "device.0.json.gz"))
    return expect_error(convert(folder), "bert_host.json", "two processes", "multiple of 4096")


@case
def host_two_ranks_one_path_fix(work: Path):
    folder = work / "run"
    folder.mkdir()
    mixed = interleave(unzip(BERT_2R / "host.0.json.gz"), unzip(BERT_2R / "host.1.json.gz"))
    (folder / "bert_host.json").write_bytes(mixed)
    return expect_error(fix(folder / "bert_host.json"), "two processes", "multiple of 4096")


@case
def host_nan_tools_agree(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    text = (folder / "host.0.json").read_bytes().replace(b'"tensor_range", "type": "string", "value": ""}',
                                                         b'"tensor_range", "type": "string", "value": NaN}', 3)
    (folder / "host.0.json").write_bytes(text)
    checked = fix(folder, "--check")
    proc = convert(folder)
    if _traceback(proc) or _traceback(checked):
        return _traceback(proc) or _traceback(checked)
    if checked.rc == 0 and proc.rc != 0:
        return "misleading", f"fix_host_traces: {checked.text.strip()[:90]}; converter: {proc.lines('error:')[0]}"
    if proc.rc == 0:
        return expect_warning(proc, "NaN")
    return expect_error(proc, "NaN")


@case
def device_nan(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    text = (folder / "device.0.json").read_bytes().replace(b'"sort_index": ', b'"sort_index": NaN, "x": ', 1)
    (folder / "device.0.json").write_bytes(text)
    proc = convert(folder)
    return expect_warning(proc, "NaN") if proc.rc == 0 else expect_error(proc, "NaN")


@case
def host_bom(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    (folder / "host.0.json").write_bytes(b"\xef\xbb\xbf" + (folder / "host.0.json").read_bytes())
    proc = convert(folder)
    if proc.rc == 0:
        return expect_warning(proc, "byte-order mark")
    return expect_error(proc, "byte-order mark", forbidden=("another process",))


@case
def host_bom_with_merged_json(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    (folder / "host.0.json").write_bytes(b"\xef\xbb\xbf" + (folder / "host.0.json").read_bytes())
    proc = convert(folder, "--emit-merged")
    outcome = expect_warning(proc, "no merged JSON")
    if outcome[0] == "clear" and not (folder / "run.0.et").is_file():
        return "lost", "no .et either"
    return outcome


@case
def host_bom_fix(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    (folder / "host.0.json").write_bytes(b"\xef\xbb\xbf" + (folder / "host.0.json").read_bytes())
    proc = fix(folder)
    if "another process" in proc.text or "two writers" in proc.text:
        return "misleading", proc.text.strip().splitlines()[0]
    return expect_ok(proc, "byte-order mark")


@case
def device_bom(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    (folder / "device.0.json").write_bytes(b"\xef\xbb\xbf" + (folder / "device.0.json").read_bytes())
    proc = convert(folder)
    return expect_warning(proc, "byte-order mark") if proc.rc == 0 else expect_error(proc, "byte-order mark")


@case
def host_is_a_device_trace(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    shutil.copyfile(folder / "device.0.json", folder / "host.0.json")
    return expect_error(convert(folder), "host.0.json", "device")


@case
def host_unknown_schema(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    text = (folder / "host.0.json").read_bytes().replace(b'"1.1.1-chakra.0.0.4"', b'"2.0.0"', 1)
    (folder / "host.0.json").write_bytes(text)
    return expect_error(convert(folder), "schema", "2.0.0")


@case
def host_gzip_cut(work: Path):
    folder = copy_run(GPT2_1R, work / "run", plain=False)
    data = (folder / "host.0.json.gz").read_bytes()
    (folder / "host.0.json.gz").write_bytes(data[:len(data) // 2])
    return expect_error(convert(folder), "host.0.json.gz")


@case
def host_duplicate_ids(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    host = load(folder / "host.0.json")
    host["nodes"] += host["nodes"][5:8]
    dump(folder / "host.0.json", host)
    return expect_error(convert(folder), "duplicate", "fix_host_traces")


@case
def host_of_another_process(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    (folder / "host.0.json").write_bytes(unzip(BERT_2R / "host.0.json.gz"))
    return expect_error(convert(folder), "not the same run")


@case
def host_of_another_capture_same_pid(work: Path):
    folder = copy_run(BERT_2R, work / "run")
    swap_in_host_of_second_capture(folder)
    proc = convert(folder)
    outcome = expect_error(proc, "host.0.json", "another capture")
    if outcome[0] == "clear" and (folder / "run.0.et").exists():
        return "wrong_ok", "refused, but run.0.et left"
    return outcome


@case
def host_more_steps_than_device(work: Path):
    return expect_warning(convert(host_with_more_steps(work / "run")), "steps")


# Broken device traces
@case
def device_truncated(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    text = (folder / "device.0.json").read_bytes()
    (folder / "device.0.json").write_bytes(text[:len(text) // 2])
    return expect_error(convert(folder), "device.0.json", "truncated")


@case
def device_not_json(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    (folder / "device.0.json").write_bytes(b"\x08\x01binary")
    return expect_error(convert(folder), "device.0.json")


@case
def device_missing(work: Path):
    folder = copy_run(BERT_2R, work / "run")
    (folder / "device.1.json").unlink()
    proc = convert(folder)
    outcome = expect_error(proc, "device.1.json", "missing")
    if outcome[0] == "clear" and not (folder / "run.0.et").is_file():
        return "lost", "rank 0 was not converted"
    return outcome


# Ranks of different runs
@case
def one_rank_run_beside_a_two_rank_run(work: Path):
    folder = work / "run"
    place_rank(GPT2_1R, 0, folder, 0)
    place_rank(GPT2_2R, 1, folder, 1)
    proc = convert(folder)
    outcome = expect_error(proc, "different runs")
    if outcome[0] == "clear" and et_files(folder):
        return "wrong_ok", f"refused, but {et_files(folder)} left"
    return outcome


@case
def two_captures_hours_apart(work: Path):
    folder = copy_run(BERT_2R, work / "run")
    shift_capture(folder, 1, hours=3, pid_offset=1000)
    proc = convert(folder)
    outcome = expect_error(proc, "different runs", "rank 1")
    if outcome[0] == "clear" and et_files(folder):
        return "wrong_ok", f"refused, but {et_files(folder)} left"
    return outcome


@case
def run_ids_differ(work: Path):
    folder = copy_run(GPT2_2R, work / "run")
    set_run_identity(folder, 0, "run-a", 2)
    set_run_identity(folder, 1, "run-b", 2)
    return expect_error(convert(folder), "different runs", "rank 1")


@case
def same_rank_copied_twice(work: Path):
    folder = work / "run"
    place_rank(BERT_2R, 0, folder, 0)
    place_rank(BERT_2R, 0, folder, 1)
    return expect_error(convert(folder), "rank 1", "rank 0")


@case
def other_model_as_rank_one(work: Path):
    folder = work / "run"
    place_rank(GPT2_2R, 0, folder, 0)
    place_rank(BERT_2R, 1, folder, 1)
    proc = convert(folder)
    outcome = expect_error(proc)
    if outcome[0] == "clear" and et_files(folder):
        return "wrong_ok", f"refused, but {et_files(folder)} left"
    return outcome


@case
def stale_run_json(work: Path):
    folder = copy_run(GPT2_2R, work / "run")
    set_run_identity(folder, 0, "run-new", 2)
    set_run_identity(folder, 1, "run-new", 2)
    info = json.loads((GPT2_2R / "run.json").read_text())
    info["run_id"] = "run-old"
    (folder / "run.json").write_text(json.dumps(info))
    return expect_error(convert(folder), "run.json")


# Stale .et files and convert_remaining
@case
def remaining_after_truncated_et(work: Path):
    folder = copy_run(BERT_2R, work / "run")
    first = convert(folder)
    if first.rc != 0:
        return expect_ok(first)
    et = folder / "run.1.et"
    et.write_bytes(et.read_bytes()[:et.stat().st_size // 2])
    proc = remaining(folder)
    if "nothing to do" in proc.text:
        return "wrong_ok", "convert_remaining: nothing to do, beside a truncated .et"
    return expect_ok(proc, "converting 1 remaining")


@case
def remaining_after_retrace(work: Path):
    folder = copy_run(BERT_2R, work / "run")
    first = convert(folder)
    if first.rc != 0:
        return expect_ok(first)
    copy_run(GPT2_2R, folder)  # traced again into the converted folder
    proc = remaining(folder)
    if "nothing to do" in proc.text:
        return "wrong_ok", "convert_remaining: nothing to do, beside new traces"
    return expect_ok(proc, "converting 2 remaining")


@case
def failed_rank_leaves_no_old_et(work: Path):
    folder = copy_run(BERT_2R, work / "run")
    first = convert(folder)
    if first.rc != 0:
        return expect_ok(first)
    (folder / "host.1.json").write_bytes(b"{")
    proc = convert(folder)
    outcome = expect_error(proc, "host.1.json")
    if outcome[0] == "clear" and (folder / "run.1.et").exists():
        return "wrong_ok", "rank 1 FAILED, its old run.1.et is still there"
    return outcome


@case
def refused_set_leaves_no_et(work: Path):
    folder = copy_run(BERT_2R, work / "run")
    first = convert(folder)
    if first.rc != 0:
        return expect_ok(first)
    place_rank(GPT2_2R, 1, folder, 1)
    proc = remaining(folder)
    outcome = expect_error(proc)
    if outcome[0] == "clear" and et_files(folder):
        return "wrong_ok", f"refused, but {et_files(folder)} left"
    return outcome


@case
def ctrl_c_during_conversion(work: Path):
    folder = copy_run(BERT_2R, work / "run")
    proc = interrupt_when("convert_to_et.py", [folder, "--no-progress", "--jobs", "1"],
                          lambda: (folder / "run.0.et").exists())
    tb = _traceback(proc) or (("traceback", "KeyboardInterrupt") if "KeyboardInterrupt" in proc.text else None)
    if tb:
        return tb
    lines = [line for line in proc.text.splitlines() if "interrupted" in line]
    return ("clear", lines[0]) if lines and proc.rc != 0 else ("misleading", proc.text.strip()[-120:])


def rank_0_done(folder: Path) -> Callable[[], bool]:
    """Ready once the summary records rank 0 as converted (or, for a converter that writes the summary only at
    the end, a moment after rank 0's .et appeared)."""
    seen: list[float] = []

    sys.path.insert(0, str(REPO))
    from trace_tools.summary import read_previous_results

    def ready() -> bool:
        done = read_previous_results(folder) or {}
        if 0 in done and done[0].ok:
            return True
        if (folder / "run.0.et").exists():
            seen.append(time.monotonic())
            return seen[-1] - seen[0] > 0.05
        return False
    return ready


@case
def ctrl_c_keeps_finished_ranks(work: Path):
    folder = copy_run(BERT_2R, work / "run")
    interrupt_when("convert_to_et.py", [folder, "--no-progress", "--jobs", "1"], rank_0_done(folder))
    if (folder / "run.1.et").exists():
        return "clear", "finished before the interrupt (nothing to check)"
    proc = remaining(folder)
    if "converting 2 remaining" in proc.text:
        return "lost", "convert_remaining redid the rank finished before Ctrl-C"
    return expect_ok(proc, "converting 1 remaining")


@case
def ctrl_c_parallel_conversion(work: Path):
    folder = copy_run(BERT_2R, work / "run")
    proc = interrupt_when("convert_to_et.py", [folder, "--no-progress", "--jobs", "2"],
                          lambda: any(folder.glob(".*unvalidated*")))
    tb = _traceback(proc) or (("traceback", "KeyboardInterrupt") if "KeyboardInterrupt" in proc.text else None)
    if tb:
        return tb
    leftovers = sorted(p.name for p in folder.glob(".*et*"))
    if leftovers:
        return "lost", f"hidden partial files left: {leftovers}"
    lines = [line for line in proc.text.splitlines() if "interrupted" in line]
    return ("clear", lines[0]) if lines and proc.rc != 0 else ("misleading", proc.text.strip()[-120:])


@case
def killed_conversion_partials_removed_next_run(work: Path):
    """SIGKILL (the OOM killer, `kill -9`) while a rank's .et is written: its hidden partial files stay until the
    next conversion of that rank, which removes them."""
    folder = copy_run(BERT_2R, work / "run")
    interrupt_when("convert_to_et.py", [folder, "--no-progress", "--jobs", "1"],
                   lambda: any(folder.glob(".*unvalidated*")), signum=signal.SIGKILL)
    outcome = expect_ok(remaining(folder))
    leftovers = sorted(p.name for p in folder.glob(".*et*"))
    if outcome[0] == "clear" and leftovers:
        return "lost", f"hidden partial files left: {leftovers}"
    return outcome


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@case
def killed_repair_temp_file_removed_next_run(work: Path):
    """fix_host_traces.py killed while it wrote the repaired copy (for a real trace, tens of MB): the next run
    removes the temp file of the dead process."""
    folder = copy_run(GPT2_1R, work / "run")
    left = folder / f".host.0.json.{dead_pid()}.k3x9q2ab.tmp"
    left.write_bytes((folder / "host.0.json").read_bytes()[:1 << 20])
    outcome = expect_ok(fix(folder))
    if outcome[0] == "clear" and left.exists():
        return "lost", f"{left.name} left"
    return outcome


# Where the outputs go
@case
def output_dir_is_a_file(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    target = work / "out"
    target.write_text("a file")
    return expect_error(convert(folder, "--output-dir", target), "--output-dir", "not a folder")


@case
def output_dir_read_only(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    target = work / "ro"
    target.mkdir()
    target.chmod(0o555)
    try:
        return expect_error(convert(folder, "--output-dir", target), "--output-dir", "writable")
    finally:
        target.chmod(0o755)


@case
def disk_full_while_writing(work: Path):
    folder = copy_run(GPT2_1R, work / "run", plain=False)
    out = work / "out"
    proc = convert(folder, "--output-dir", out, preexec=limit_file_size(64 << 10))
    outcome = expect_error(proc, "run.0.et", forbidden=("internal error", "host.0.json"))
    return outcome


@case
def disk_full_before_the_summary(work: Path):
    folder = copy_run(GPT2_1R, work / "run", plain=False)
    out = work / "out"
    proc = convert(folder, "--output-dir", out, preexec=limit_file_size(1024))
    outcome = expect_error(proc, "CONVERSION_SUMMARY.md", "cannot write", forbidden=("internal error",))
    leftovers = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if outcome[0] == "clear" and leftovers:
        return "lost", f"partial files left: {leftovers}"
    return outcome


# fix_host_traces.py
@case
def fix_concatenated_then_convert(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    text = (folder / "host.0.json").read_bytes()
    (folder / "host.0.json").write_bytes(text + text)
    repaired = fix(folder)
    if repaired.rc != 0:
        return expect_ok(repaired)
    return expect_ok(convert(folder))


@case
def fix_read_only_file(work: Path):
    folder = copy_run(GPT2_1R, work / "run")
    text = (folder / "host.0.json").read_bytes()
    (folder / "host.0.json").write_bytes(text[:len(text) // 2])
    folder.chmod(0o555)
    try:
        return expect_error(fix(folder), "read-only")
    finally:
        folder.chmod(0o755)


@case
def fix_no_traces(work: Path):
    return expect_error(fix(work), "no host traces")


# The tracer's files
@case
def retrace_killed_before_window_keeps_previous(work: Path):
    out = work / "outputs"
    first = trace_mlp(work, out, "mlp")
    if first.rc != 0:
        return "traceback", (first.err.strip().splitlines() or ["tracer failed"])[-1]
    before = {p.name: p.read_bytes() for p in (out / "mlp").iterdir() if p.is_file()}
    trace_mlp(work, out, "mlp", kill_at=0)
    after = {p.name: p.read_bytes() for p in (out / "mlp").iterdir() if p.is_file()}
    lost = sorted(name for name in before if before[name] != after.get(name))
    return ("lost", f"previous traces gone: {lost}") if lost else ("clear", "previous traces kept")


@case
def retrace_moves_the_old_conversion_away(work: Path):
    out = work / "outputs"
    first = trace_mlp(work, out, "mlp")
    if first.rc != 0:
        return "traceback", (first.err.strip().splitlines() or ["tracer failed"])[-1]
    converted = convert(out / "mlp")
    if converted.rc != 0:
        return expect_ok(converted)
    old_host = (out / "mlp" / "host.0.json").read_bytes()
    second = trace_mlp(work, out, "mlp")
    if second.rc != 0:
        return "traceback", (second.err.strip().splitlines() or ["tracer failed"])[-1]
    stale = [name for name in ("mlp.0.et", "CONVERSION_SUMMARY.md") if (out / "mlp" / name).exists()]
    if stale:
        return "wrong_ok", f"the previous run's {', '.join(stale)} left beside the new traces"
    kept = [p for p in out.rglob("host.0.json") if p.read_bytes() == old_host]
    return ("clear", f"previous run kept in {kept[0].parent}") if kept else ("lost", "previous traces deleted")


# ---- running the corpus ------------------------------------------------------------------------------------------
def run_cases(names: list[str] | None = None, verbose: bool = False) -> list[dict]:
    """Run the cases (all, or those named) each in a fresh temporary folder; [{"case", "outcome", "message"}]."""
    results = []
    for number, name in enumerate(names or list(CASES)):
        work = Path(tempfile.mkdtemp(prefix=f"fault{number}-"))  # not the case's name: messages quote the path
        try:
            outcome, message = CASES[name](work)
        except subprocess.TimeoutExpired as e:
            outcome, message = "traceback", f"timed out: {e}"
        finally:
            for path in work.rglob("*"):  # cases chmod things read-only
                if path.is_dir():
                    path.chmod(0o755)
            shutil.rmtree(work, ignore_errors=True)
        assert outcome in OUTCOMES, (name, outcome)
        results.append({"case": name, "outcome": outcome, "message": message})
        if verbose:
            print(f"{outcome:10s} {name}: {message}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"cases to run (default: all {len(CASES)})")
    args = parser.parse_args(argv)
    unknown = [name for name in args.cases if name not in CASES]
    if unknown:
        print(f"error: unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    results = run_cases(args.cases or None, verbose=True)
    counts = Counter(r["outcome"] for r in results)
    print(f"{len(results)} conversion fault cases: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES))
    return 0 if counts["clear"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
