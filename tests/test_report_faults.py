"""trace_report.py on damaged run folders: one line naming the file, a non-zero exit, and the earlier report intact."""
from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO / "tests" / "data" / "cpu" / "bert_tiny_2r"  # a real 2-rank gloo run, converted in about a second
RUN = "bert_tiny_2r"


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)


def _convert(traces: Path, out: Path) -> subprocess.CompletedProcess:
    return _run(["convert_to_et.py", str(traces), "--output-dir", str(out), "--no-progress", "--jobs", "2"])


@pytest.fixture(scope="session")
def reported_run(tmp_path_factory) -> Path:
    """The bundled BERT run converted (CONVERSION_SUMMARY.md records both ranks) and reported on."""
    out = tmp_path_factory.mktemp("reported") / RUN
    done = _convert(TRACES, out)
    assert done.returncode == 0, done.stderr[-2000:]
    done = _run(["trace_report.py", str(out), "--no-hta"])
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def run(reported_run, tmp_path) -> Path:
    copy = tmp_path / RUN
    shutil.copytree(reported_run, copy)
    return copy


def snapshot(folder: Path) -> dict[str, bytes | str]:
    return {p.name: "<folder>" if p.is_dir() else p.read_bytes() for p in folder.iterdir()}


def reconvert(folder: Path) -> str:
    return f"{sys.executable} {REPO}/convert_remaining.py {TRACES} --output-dir {folder}"


# ---------------------------------------------------------------------------------------------------------------
# The report's own files: a folder in the way, a rename that fails
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["report.md", "report.json", "report_timeline_rank1.png",
                                  "report_timeline_rank7.png"])  # the last: an earlier figure the report removes
def test_a_folder_where_the_report_has_a_file_is_refused_before_anything_is_written(run, name):
    """A folder at report.md had given a traceback (IsADirectoryError) after the new report.json was moved in: half
    a report, exit 1."""
    (run / name).unlink(missing_ok=True)
    (run / name).mkdir()
    before = snapshot(run)
    done = _run(["trace_report.py", str(run), "--no-hta"])
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: {run / name}: a folder, where trace_report.py writes its {name}; move it "
                                   "away and report again")
    assert done.stdout == ""
    assert snapshot(run) == before


def test_a_rename_that_fails_while_the_report_is_moved_in_puts_the_earlier_report_back(run):
    """The last file of the report cannot be moved in (here a disk error, once): the files moved in before it go, the
    earlier report comes back whole, with its figure this report would have removed, and the error is one line."""
    shutil.copy(run / "report_timeline_rank0.png", run / "report_timeline_rank5.png")  # of a rank gone since
    before = snapshot(run)
    done = _run(["-c", "import errno, os, sys, trace_report, trace_tools.report as r\n"
                       "replace, failed = os.replace, []\n"
                       "def failing(source, target):\n"
                       "    if str(target).endswith('report_top_ops.png') and not failed:\n"
                       "        failed.append(target)\n"
                       "        raise OSError(errno.EIO, os.strerror(errno.EIO))\n"
                       "    replace(source, target)\n"
                       "r.os.replace = failing\n"
                       f"sys.exit(trace_report.main([{str(run)!r}, '--no-hta']))"])
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: {run / 'report_top_ops.png'}: cannot move the report in (Input/output "
                                   "error); the earlier report is kept as it was")
    assert snapshot(run) == before
    assert not list(run.glob(".report.*"))
    # with the disk mended, the report moves in, and the figure of the rank that is gone goes
    done = _run(["trace_report.py", str(run), "--no-hta"])
    assert done.returncode == 0, done.stderr
    assert sorted(snapshot(run)) == sorted(set(before) - {"report_timeline_rank5.png"})


# ---------------------------------------------------------------------------------------------------------------
# Ranks without an .et: deleted since the conversion, or never converted
# ---------------------------------------------------------------------------------------------------------------
def test_a_rank_deleted_after_it_was_converted_is_refused_not_called_failed(run):
    """rank 1's .et deleted after a conversion that succeeded: the report of rank 0 alone had said `no .et for
    rank(s) 1 (see CONVERSION_SUMMARY.md for why they failed)`, exit 0; the summary says it was converted."""
    (run / f"{RUN}.1.et").unlink()
    before = snapshot(run)
    done = _run(["trace_report.py", str(run), "--no-hta"])
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: {run / f'{RUN}.1.et'}: missing, though {run / 'CONVERSION_SUMMARY.md'} "
                                   f"records it converted ({reconvert(run)} makes it again)")
    assert snapshot(run) == before
    # the command as printed makes the rank again, and the report follows
    command = done.stderr.strip().split(" (", 1)[1].removesuffix(" makes it again)")
    again = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    done = _run(["trace_report.py", str(run), "--no-hta"])
    assert done.returncode == 0, done.stderr
    assert orjson.loads((run / "report.json").read_bytes())["missing_ranks"] == []


def test_a_folder_in_place_of_a_converted_ranks_et_is_refused(run):
    (run / f"{RUN}.1.et").unlink()
    (run / f"{RUN}.1.et").mkdir()
    before = snapshot(run)
    done = _run(["trace_report.py", str(run), "--no-hta"])
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: {run / f'{RUN}.1.et'}: a folder, though {run / 'CONVERSION_SUMMARY.md'} "
                                   f"records the rank's .et converted (move it away; {reconvert(run)} makes the .et "
                                   "again)")
    assert snapshot(run) == before


def test_a_rank_whose_conversion_failed_is_reported_as_failed(tmp_path):
    """rank 1's host trace cut short: its conversion failed, and the report of rank 0 says where to read why."""
    traces = tmp_path / "traces"
    shutil.copytree(TRACES, traces)
    host = traces / "host.1.json.gz"
    data = gzip.decompress(host.read_bytes())
    host.write_bytes(gzip.compress(data[: len(data) // 3]))
    out = tmp_path / "out"
    done = _convert(traces, out)
    assert done.returncode == 1 and "host.1.json.gz: truncated JSON" in done.stdout + done.stderr
    assert sorted(p.name for p in out.glob("*.et")) == ["traces.0.et"]
    done = _run(["trace_report.py", str(out), "--no-hta"])
    assert done.returncode == 0, done.stderr
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["ranks"] == [0] and report["missing_ranks"] == [1] and report["failed_ranks"] == [1]
    assert "**Missing ranks:** no `.et` for rank(s) 1 (see CONVERSION_SUMMARY.md for why they failed)." in \
        (out / "report.md").read_text()


def test_a_missing_rank_no_summary_records_is_not_said_to_have_failed(run):
    """.et files copied out of their folder without rank 1: nothing says its conversion failed, and there is no
    CONVERSION_SUMMARY.md to see."""
    (run / "CONVERSION_SUMMARY.md").unlink()
    (run / f"{RUN}.1.et").unlink()
    done = _run(["trace_report.py", str(run), "--no-hta"])
    assert done.returncode == 0, done.stderr
    report = orjson.loads((run / "report.json").read_bytes())
    assert report["missing_ranks"] == [1] and report["failed_ranks"] == []
    md = (run / "report.md").read_text()
    assert "**Missing ranks:** no `.et` for rank(s) 1 (no conversion of theirs is recorded here)." in md
    assert "why they failed" not in md


# ---------------------------------------------------------------------------------------------------------------
# A set no summary records: a rank's file in place of another's
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["copied", "hard-linked"])
def test_a_ranks_file_put_over_another_ranks_is_refused(run, how):
    """`cp x.0.et x.1.et` in a set no CONVERSION_SUMMARY.md records: the same collectives, so it passed as a run,
    and the report described rank 0 twice, exit 0."""
    for path in [run / "CONVERSION_SUMMARY.md", *run.glob("report*")]:
        path.unlink()
    rank1 = run / f"{RUN}.1.et"
    rank1.unlink()
    (shutil.copy if how == "copied" else os.link)(run / f"{RUN}.0.et", rank1)
    before = snapshot(run)
    done = _run(["trace_report.py", str(run), "--no-hta"])
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: {rank1}: holds rank 0 of its run, not rank 1 as its name says (a rank's "
                                   "file copied or renamed over another's); convert the run again")
    assert snapshot(run) == before


def test_the_ranks_of_a_set_no_summary_records_are_reported_when_each_is_its_own(run):
    (run / "CONVERSION_SUMMARY.md").unlink()
    done = _run(["trace_report.py", str(run), "--no-hta"])
    assert done.returncode == 0, done.stderr
    assert orjson.loads((run / "report.json").read_bytes())["ranks"] == [0, 1]
