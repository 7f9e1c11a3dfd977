"""Real traces changed one field at a time, as other PyTorch versions, other tools or damaged copies write them:
each converts to the .et of the original, or converts with a warning that says what was left out, or fails with
one line that names the file; never a traceback, never a quietly different .et.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from conversion_helpers import CPU_FIXTURES, read_json
from trace_tools import cli
from trace_tools.validate import validate_et

GPT2 = CPU_FIXTURES / "gpt2_tiny_1r"
# The smallest GPU trace of the team's reference traces (4 KB: one step, 4 kernels); beside the clone, not in it.
GPU_ADD = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "gpu" / "hta_simple_add_a100_1r"


def copy_run(source: Path, folder: Path) -> Path:
    folder.mkdir(parents=True)
    for kind in ("host", "device"):
        (folder / f"{kind}.0.json").write_bytes(gzip.decompress((source / f"{kind}.0.json.gz").read_bytes()))
    return folder


def mutate(folder: Path, kind: str, change) -> None:
    path = folder / f"{kind}.0.json"
    document = json.loads(path.read_bytes())
    change(document)
    path.write_text(json.dumps(document))


def convert(folder: Path, capsys) -> tuple[int, str, list[str], list[str]]:
    code = cli.main([str(folder), "--output-dir", str(folder / "out"), "--no-progress"])
    captured = capsys.readouterr()
    output = captured.out + captured.err
    lines = output.splitlines()
    return code, output, [l for l in lines if l.startswith("error: ")], [l for l in lines if l.startswith("warning: ")]


def et_of(folder: Path) -> Path:
    return folder / "out" / f"{folder.name}.0.et"


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """The unchanged gpt2_tiny_1r conversion: nodes and critical path to compare with."""
    folder = copy_run(GPT2, tmp_path_factory.mktemp("original") / "run")
    assert cli.main([str(folder), "--output-dir", str(folder / "out"), "--no-progress"]) == 0
    return validate_et(et_of(folder))


def every_seventh_event(document, categories=("cpu_op", "user_annotation")):
    events = [e for e in document["traceEvents"] if e.get("ph") == "X" and e.get("cat") in categories]
    return events[::7]


def middle_event(document, category):
    events = [e for e in document["traceEvents"] if e.get("ph") == "X" and e.get("cat") == category]
    return events[len(events) // 2]


def every_seventh_operator(document):
    return [n for n in document["nodes"] if not n["name"].startswith("[pytorch|")][::7]


# ---- fields of another JSON type than the writer's: read as missing, not a traceback ---------------------------
DEVICE_FIELDS = {
    "args_a_list": lambda e: e.update(args=[e["args"]]),
    "args_a_string": lambda e: e.update(args="x"),
    "name_null": lambda e: e.update(name=None),
    "name_a_number": lambda e: e.update(name=12345),
}
HOST_FIELDS = {
    "attrs_an_object": lambda n: n.update(attrs={a["name"]: a["value"] for a in n["attrs"]}),
    "attrs_of_pairs": lambda n: n.update(attrs=[[a["name"], a["value"]] for a in n["attrs"]]),
    "inputs_a_list": lambda n: n.update(inputs=n["inputs"]["values"]),
    "name_null": lambda n: n.update(name=None),
}


@pytest.mark.parametrize("field", list(DEVICE_FIELDS))
def test_device_events_with_a_field_of_another_type_are_read_without_it(tmp_path, capsys, original, field):
    folder = copy_run(GPT2, tmp_path / "run")
    mutate(folder, "device", lambda d: [DEVICE_FIELDS[field](e) for e in every_seventh_event(d)])
    code, output, errors, warnings = convert(folder, capsys)
    assert "internal error" not in output and "Traceback" not in output
    assert code == 0, errors
    report = validate_et(et_of(folder))
    assert report.ok and report.nodes == original.nodes
    if field.startswith("args"):  # without its Record function id an event matches no host operator, and says so
        assert any("host operators have a Kineto event" in w for w in warnings), warnings


@pytest.mark.parametrize("field", list(HOST_FIELDS))
def test_host_nodes_with_a_field_of_another_type_are_read_without_it(tmp_path, capsys, original, field):
    folder = copy_run(GPT2, tmp_path / "run")
    mutate(folder, "host", lambda d: [HOST_FIELDS[field](n) for n in every_seventh_operator(d)])
    code, output, errors, _ = convert(folder, capsys)
    assert "internal error" not in output and "Traceback" not in output
    assert code == 0, errors
    assert validate_et(et_of(folder)).ok


def test_a_host_node_without_an_integer_id_is_one_line_naming_the_node(tmp_path, capsys):
    folder = copy_run(GPT2, tmp_path / "run")
    mutate(folder, "host", lambda d: every_seventh_operator(d)[3].update(id=None))
    code, output, errors, _ = convert(folder, capsys)
    assert code == 1 and "internal error" not in output
    assert len(errors) == 1 and "host.0.json" in errors[0] and "no integer 'id' (None)" in errors[0]
    assert not list((folder / "out").glob("*.et"))


# ---- times: what cannot be placed is left out and counted; numbers written as text are numbers -----------------
def test_events_with_a_negative_or_missing_duration_are_left_out_and_counted(tmp_path, capsys, original):
    folder = copy_run(GPT2, tmp_path / "run")

    def damage(document):
        for i, event in enumerate(every_seventh_event(document)):
            if i % 2:
                event["dur"] = -event["dur"] - 1
            else:
                del event["dur"]
    mutate(folder, "device", damage)
    code, _, errors, warnings = convert(folder, capsys)
    assert code == 0, errors
    assert any("device.0.json: 328 event(s) left out" in w and "negative duration" in w for w in warnings), warnings
    report = validate_et(et_of(folder))
    # a negative duration read as one made the critical path 1.36 times the step it came from
    assert report.critical_path_us == pytest.approx(report.traced_step_us, rel=0.01)


@pytest.mark.parametrize("category", ["cpu_op", "user_annotation"])
def test_an_event_ending_after_the_profilers_window_is_left_out_and_named(tmp_path, capsys, original, category):
    # Kineto keeps no activity that ends after its "Record Window End": a duration that runs past it (here 1e15 µs,
    # 31 years) is not a measurement. Taken as it was, it became a step of 31 years.
    folder = copy_run(GPT2, tmp_path / "run")
    mutate(folder, "device", lambda d: middle_event(d, category).update(dur=1e15))
    code, _, errors, warnings = convert(folder, capsys)
    assert code == 0, errors
    assert any("device.0.json: 1 event(s) left out (1 CPU operator)" in w and "Record Window End" in w
               for w in warnings), warnings
    report = validate_et(et_of(folder))
    assert report.critical_path_us == pytest.approx(original.critical_path_us, rel=0.05)


def test_gpu_activity_ending_after_the_profilers_window_is_left_out_and_named(tmp_path, capsys):
    if not GPU_ADD.is_dir():
        pytest.skip(f"{GPU_ADD} not found: the reference traces live beside the team's clones")
    folder = copy_run(GPU_ADD, tmp_path / "run")

    def stretch_first_kernel(document):
        next(e for e in document["traceEvents"] if e.get("cat") == "kernel")["dur"] = 1e15
    mutate(folder, "device", stretch_first_kernel)
    code, _, errors, warnings = convert(folder, capsys)
    assert code == 0, errors
    assert any("1 event(s) left out (1 GPU activity)" in w and "Record Window End" in w for w in warnings), warnings
    assert validate_et(et_of(folder)).critical_path_us < 1e9


def test_a_device_trace_whose_events_have_no_duration_is_refused_in_one_line(tmp_path, capsys):
    folder = copy_run(GPT2, tmp_path / "run")
    mutate(folder, "device", lambda d: [e.pop("dur", None) for e in d["traceEvents"]])
    code, output, errors, _ = convert(folder, capsys)
    assert code == 1 and "internal error" not in output
    assert len(errors) == 1 and "device.0.json: none of its 2296 CPU operator events" in errors[0]
    assert not list((folder / "out").glob("*.et"))


def test_times_ids_and_pids_written_as_text_give_the_same_et(tmp_path, capsys, original):
    folder = copy_run(GPT2, tmp_path / "run")

    def as_text(document):
        for event in document["traceEvents"]:
            for key in ("ts", "dur", "pid"):
                if isinstance(event.get(key), (int, float)):
                    event[key] = str(event[key])
            args = event.get("args") or {}
            for key in ("Record function id", "External id"):
                if key in args:
                    args[key] = str(args[key])
    mutate(folder, "device", as_text)
    mutate(folder, "host", lambda d: d.update(pid=str(d["pid"])))
    code, _, errors, warnings = convert(folder, capsys)
    # the fixture has no run.json, which is said once for the run; the text fields add no warning
    assert code == 0 and [w for w in warnings if "no run.json beside the traces" not in w] == [], errors + warnings
    report = validate_et(et_of(folder))
    assert (report.nodes, report.critical_path_us) == (original.nodes, original.critical_path_us)


# ---- GPU work whose launch is not in the trace ------------------------------------------------------------------
def test_gpu_work_without_its_launching_runtime_call_is_named_not_counted_as_outside_the_step(tmp_path, capsys):
    if not GPU_ADD.is_dir():
        pytest.skip(f"{GPU_ADD} not found: the reference traces live beside the team's clones")
    folder = copy_run(GPU_ADD, tmp_path / "run")
    kernels = sum(1 for e in read_json(GPU_ADD / "device.0.json.gz")["traceEvents"] if e.get("cat") == "kernel")
    mutate(folder, "device", lambda d: d.update(traceEvents=[e for e in d["traceEvents"]
                                                             if e.get("cat") != "cuda_runtime"]))
    code, _, errors, warnings = convert(folder, capsys)
    assert code == 0, errors
    assert any(f"{kernels} of its {kernels} GPU ops" in w and "left out of the .et" in w for w in warnings), warnings
    summary = (folder / "out" / "CONVERSION_SUMMARY.md").read_text()
    assert f"0 GPU ops linked (0 of the device trace outside the step, {kernels} without their launching" in summary


def test_kernel_launches_whose_kernels_the_trace_lost_are_named(tmp_path, capsys):
    if not GPU_ADD.is_dir():
        pytest.skip(f"{GPU_ADD} not found: the reference traces live beside the team's clones")
    folder = copy_run(GPU_ADD, tmp_path / "run")
    mutate(folder, "device", lambda d: d.update(traceEvents=[e for e in d["traceEvents"] if e.get("cat") != "kernel"]))
    code, _, errors, warnings = convert(folder, capsys)
    assert code == 0, errors
    assert any("kernel launch calls have no GPU kernel in the trace" in w for w in warnings), warnings


def test_a_device_trace_whose_window_end_comes_before_most_of_it_names_that(tmp_path, capsys):
    # a device trace joined or edited by hand, whose "Record Window End" no longer closes it: its events past the
    # mark are left out, and the host trace's operators are then among them; the error says so, not "another run"
    folder = copy_run(GPT2, tmp_path / "run")

    def end_early(document):
        starts = sorted(e["ts"] for e in document["traceEvents"] if e.get("ph") == "X")
        marker = next(e for e in document["traceEvents"] if e.get("name") == "Record Window End")
        marker["ts"] = starts[len(starts) // 10]
    mutate(folder, "device", end_early)
    code, output, errors, _ = convert(folder, capsys)
    assert code == 1 and "internal error" not in output
    assert len(errors) == 1 and "device.0.json" in errors[0] and "Record Window End" in errors[0], errors
    assert "different runs" not in errors[0]
    assert not list((folder / "out").glob("*.et"))
