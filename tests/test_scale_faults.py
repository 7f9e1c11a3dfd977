"""scale_et.py on bad flags and doctored sets: refused in one line before anything is allocated or written."""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys

import pytest

import scale_et
from test_scale import GPT2_2R, REPO
from trace_tools import scale
from trace_tools.scale import read_source_et, scaled_step_us, scale_set
from trace_tools.validate import CLOCK_LIMIT_NS, validate_et

# A child that would build a list per rank (the defect) stops at this much address space, not at the machine's memory.
CHILD_MEMORY = 2 << 30


def run_scale_et(args: list, *, open_files: int | None = None) -> tuple[subprocess.CompletedProcess, int]:
    """scale_et.py in a child under CHILD_MEMORY of address space (and `open_files` as its hard limit of open
    files): its result and its peak resident memory in bytes."""
    def limits():
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
    code = ("import resource, sys, scale_et\n"
            "code = scale_et.main(sys.argv[1:])\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"  # KiB on Linux
            "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, preexec_fn=limits)
    return done, int(done.stdout.split()[-1]) * 1024


# ---- --ranks: a count this machine or ASTRA-sim cannot take ---------------------------------------------------------
def test_a_rank_count_whose_lists_alone_pass_memory_is_refused_before_they_are_built(gpt2_run, tmp_path):
    """--ranks 99999999999999999999999 had been killed by the OOM killer (exit 137, no message) while it built a
    list a rank; under an address-space limit it filled that limit first."""
    out = tmp_path / "out"
    done, peak = run_scale_et([gpt2_run, "--ranks", "9" * 23, "--output-dir", out])
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("error: --ranks: 99,999,999,999,999,999,999,999 ranks need more memory than this process "
                           "may use, for their list alone (and a file name each); give fewer\n")
    assert peak < 512 << 20, f"{peak / 2**20:.0f} MiB: the lists were built before the count was refused"
    assert not out.exists()


def test_more_ranks_than_astra_sim_can_open_files_for_are_refused_before_a_file_is_written(gpt2_run, tmp_path):
    """--ranks 100000000 had written 7.1 million hard links before the disk refused more; ASTRA-sim keeps every
    NPU's .et open, so this shell (hard limit of open files: 64 here) could never have run the set."""
    out = tmp_path / "out"
    done, _ = run_scale_et([gpt2_run, "--ranks", 100, "--output-dir", out], open_files=64)
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("error: --ranks: 100 NPUs need 105 open files (ASTRA-sim keeps each NPU's .et open), but "
                           "this shell allows 64 (ulimit -Hn); raise the hard limit (/etc/security/limits.conf, or "
                           "ulimit -n as root) or simulate fewer ranks\n")
    assert not out.exists()


class FullDisk:
    """os.statvfs of a disk with `bytes_free` and `inodes_free` left."""

    def __init__(self, bytes_free: int, inodes_free: int):
        self.f_frsize, self.f_bavail = 4096, bytes_free // 4096
        self.f_files, self.f_favail = 1_000_000, inodes_free


@pytest.mark.parametrize("disk, says", [
    (FullDisk(8 << 10, 1000), " MiB (2 files and a folder entry a rank), and the disk has 8.0 KiB free; free space "
                              "or give fewer --ranks"),
    (FullDisk(1 << 40, 3), "4 inodes (2 files, the staging folder and SCALE_SUMMARY.md), and the disk has 3 "
                           "free; free some"),
])
def test_a_set_its_disk_has_no_room_for_is_refused_before_a_file_is_written(gpt2_run, tmp_path, monkeypatch, capsys,
                                                                            disk, says):
    written = []
    monkeypatch.setattr(scale, "write_scaled_et", lambda *args, **kwargs: written.append(args))
    monkeypatch.setattr(os, "statvfs", lambda path: disk)
    out = tmp_path / "out"
    assert scale_et.main([str(gpt2_run), "--ranks", "8", "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}: no room for 8 ranks: they need ") and err.endswith(f"{says}\n"), err
    assert err.count("\n") == 1
    assert not written and not out.exists()


# ---- --slow: a factor past ASTRA-sim's clock ------------------------------------------------------------------------
@pytest.mark.parametrize("factor, says", [
    ("1e305", "--slow 1:1e+305: makes rank 1's step "),  # had been an OverflowError traceback
    ("1e20", "--slow 1:1e+20: makes rank 1's step "),  # had been refused once the slowed file was written
    ("1e8", "--slow 1:1e+08: makes rank 1's step "),  # 283 days
    ("inf", "--slow 1:inf: makes rank 1's step infinite, past what ASTRA-sim's clock counts"),
    ("1e309", "--slow 1:inf: makes rank 1's step infinite, past what ASTRA-sim's clock counts"),
    ("nan", "--slow: factor nan of rank 1 must be a positive number"),
    ("-inf", "--slow: factor -inf of rank 1 must be a positive number"),
])
def test_a_slow_factor_past_the_simulators_clock_is_refused_before_a_file_is_written(gpt2_run, tmp_path, monkeypatch,
                                                                                     capsys, factor, says):
    written = []
    monkeypatch.setattr(scale, "write_scaled_et", lambda *args, **kwargs: written.append(args))
    out = tmp_path / "new" / "out"
    assert scale_et.main([str(gpt2_run), "--ranks", "4", "--slow", f"1:{factor}", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}") and err.count("\n") == 1, err
    assert "past what ASTRA-sim's clock counts (2^53 ns, 104 days); give a smaller factor" in err or "positive" in err
    assert not written and not (tmp_path / "new").exists()


def test_the_step_checked_before_writing_is_the_one_the_written_straggler_has(gpt2_run, tmp_path):
    """The check times the slowed rank without writing its file; the file written has that step to the µs, and a
    factor whose step fits ASTRA-sim's clock (1e7: 28 days) is written."""
    source = read_source_et(gpt2_run / f"{GPT2_2R}.1.et")
    for factor in (1.5, 1e7):
        result = scale_set(gpt2_run, 4, output_dir=tmp_path / f"x{factor:g}", slow={1: factor})
        written = validate_et(result.output_dir / f"{result.name}.1.et")
        step = scaled_step_us(source, ranks=4, traced_ranks=2, compute_scale=factor)
        assert written.critical_path_us == step == result.critical_path_us[1]
        assert step * 1000 < CLOCK_LIMIT_NS
    assert step > 1e6 * validate_et(gpt2_run / f"{GPT2_2R}.1.et").critical_path_us  # the factor slowed the step


# ---- --output-dir and --name: empty values ---------------------------------------------------------------------
@pytest.mark.parametrize("flag, says", [
    ("--output-dir", "error: --output-dir '': an empty path; give the folder the set goes in (or leave the flag out "
                     "for one beside the run)\n"),
    ("--name", "error: --name: '': use letters, digits and _ . + - (it becomes <name>.<rank>.et)\n"),
])
def test_an_empty_output_folder_or_name_is_refused_not_taken_as_the_default(gpt2_run, tmp_path, monkeypatch, capsys,
                                                                           flag, says):
    """--output-dir "" (an unset shell variable) wrote the set into the current folder; --name "" took the default
    name."""
    runs = tmp_path / "runs"
    shutil.copytree(gpt2_run, runs / GPT2_2R)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert scale_et.main([str(runs / GPT2_2R), "--ranks", "4", flag, ""]) == 2
    assert capsys.readouterr().err == says
    assert not any(here.iterdir()) and sorted(p.name for p in runs.iterdir()) == [GPT2_2R]


# ---- a rank's file copied over another's, in a set no summary records --------------------------------------------
def test_a_ranks_file_copied_over_anothers_is_refused_where_no_summary_records_the_set(gpt2_run, tmp_path, capsys):
    """`cp x.0.et x.1.et` in a set with no CONVERSION_SUMMARY.md: the two files run the same collectives and pass
    every other check, and rank 0 was scaled to every rank."""
    folder = tmp_path / GPT2_2R
    folder.mkdir()
    for rank in (0, 1):
        shutil.copy(gpt2_run / f"{GPT2_2R}.0.et", folder / f"{GPT2_2R}.{rank}.et")
    out = tmp_path / "out"
    assert scale_et.main([str(folder), "--ranks", "4", "--output-dir", str(out), "--assume-data-parallel"]) == 1
    assert capsys.readouterr().err == (f"error: {folder}/{GPT2_2R}.1.et: holds rank 0 of its run, not rank 1 as its "
                                       "name says (a rank's file copied or renamed over another's); convert the run "
                                       "again\n")
    assert not out.exists()

    shutil.copy(gpt2_run / f"{GPT2_2R}.1.et", folder)  # the set as converted scales
    assert scale_et.main([str(folder), "--ranks", "4", "--output-dir", str(out), "--assume-data-parallel"]) == 0
    assert sorted(p.name for p in out.glob("*.et")) == [f"{GPT2_2R}_4npus.{r}.et" for r in range(4)]
