"""./run_tests.sh's workers: several at once, and a test marked `alone` with none beside it."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Each test notes when it started and ended; the `alone` one sleeps longest, so the others would overlap it.
TIMED_TESTS = '''
import json, os, time
from pathlib import Path
import pytest

def note(name, seconds):
    started = time.monotonic()
    time.sleep(seconds)
    record = {"name": name, "start": started, "end": time.monotonic(), "pid": os.getpid()}
    with open(Path(os.environ["TIMES"]) / f"{name}.json", "w") as out:
        json.dump(record, out)

@pytest.mark.parametrize("index", range(6))
def test_beside_others(index):
    note(f"beside_{index}", 0.4)

@pytest.mark.alone
def test_alone():
    note("alone", 1.0)
'''


def test_an_alone_test_runs_with_no_other_workers_test_beside_it_while_the_others_run_in_parallel(tmp_path):
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(REPO / "pytest.ini", tmp_path / "pytest.ini")
    (tmp_path / "pytest.ini").write_text((tmp_path / "pytest.ini").read_text().replace("testpaths = tests\n", ""))
    (tmp_path / "test_timed.py").write_text(TIMED_TESTS)
    times = tmp_path / "times"
    times.mkdir()
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-n", "2", "--dist", "worksteal", "-p", "no:cacheprovider",
                            "-q", str(tmp_path)], cwd=tmp_path, env=dict(os.environ, TIMES=str(times)),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
    records = {r["name"]: r for r in (json.loads(p.read_text()) for p in times.glob("*.json"))}
    assert len(records) == 7
    alone, others = records.pop("alone"), list(records.values())
    assert len({r["pid"] for r in others} | {alone["pid"]}) == 2  # both workers ran tests
    overlapping = [r["name"] for r in others if r["start"] < alone["end"] and alone["start"] < r["end"]]
    assert overlapping == []
    # the other tests did run two at a time
    assert any(a["start"] < b["end"] and b["start"] < a["end"] and a["pid"] != b["pid"]
               for a in others for b in others)
    # the run's lock files go with it
    assert not list(Path(tempfile.gettempdir()).glob(f"mosim-tests-{run.pid}.*"))
