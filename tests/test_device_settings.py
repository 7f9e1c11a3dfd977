"""GPU settings decided without a GPU (bf16 only where native, TF32, MFU peaks, loader workers) and the machine load
recorded around the traced window. The GPU is mocked: these run on any machine."""
import dataclasses
import os
import time
from pathlib import Path

import pytest
import torch

from utils import metrics, precision
from utils.metrics import (BUSY_OTHER_CPU_SHARE, busy_machine_warning, machine_load_between, peak_flops_per_gpu,
                           sample_machine_load)


@pytest.fixture
def gpu(monkeypatch):
    """A pretend CUDA device: name and compute capability as given."""
    def make(name: str, capability: tuple):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        return torch.device("cuda", 0)
    return make


# ---- precision ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, capability, expected", [
    ("Tesla V100-SXM2-16GB", (7, 0), "fp16"),
    ("Tesla T4", (7, 5), "fp16"),
    ("NVIDIA A100-SXM4-80GB", (8, 0), "bf16"),
    ("NVIDIA H100 80GB HBM3", (9, 0), "bf16"),
])
def test_default_precision_is_bf16_only_on_gpus_with_native_bf16(gpu, name, capability, expected):
    gpu(name, capability)
    assert precision.default_precision() == expected
    assert (precision.bf16_refusal() is None) == (expected == "bf16")


def test_bf16_asked_for_on_an_emulating_gpu_is_refused_with_the_fix(gpu, monkeypatch):
    gpu("Tesla V100-SXM2-16GB", (7, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # what recent torch says on a V100
    message = precision.bf16_refusal()
    assert "Tesla V100-SXM2-16GB (compute capability 7.0) has no native bf16" in message
    assert message.endswith("use --precision fp16")


def test_cpu_trains_in_fp32_and_keeps_its_matmul_precision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert precision.default_precision() == "fp32" and precision.bf16_refusal() is None
    before = torch.get_float32_matmul_precision()
    precision.enable_tf32_matmuls(torch.device("cpu"))
    assert torch.get_float32_matmul_precision() == before


def test_tf32_is_switched_on_for_cuda_matmuls_and_convolutions(monkeypatch):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        precision.enable_tf32_matmuls(torch.device("cuda", 0))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("name, setting, tf32, expected_tflops", [
    ("Tesla V100-SXM2-16GB", "fp16", True, 125.0),
    ("Tesla T4", "fp16", True, 65.0),
    ("Tesla V100-SXM2-16GB", "fp32", True, 15.7),    # no TF32 tensor cores: the fp32 peak
    ("NVIDIA A100-SXM4-80GB", "fp32", True, 156.0),  # TF32 on: the TF32 peak
    ("NVIDIA A100-SXM4-80GB", "fp32", False, 19.5),
    ("NVIDIA A100-SXM4-80GB", "bf16", True, 312.0),
])
def test_mfu_peak_matches_the_format_the_gpu_actually_runs(gpu, name, setting, tf32, expected_tflops):
    device = gpu(name, (8, 0))
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        assert peak_flops_per_gpu(device, setting) == pytest.approx(expected_tflops * 1e12)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


# ---- machine load during the traced window ----------------------------------------------------------------------
def fake_proc(root: Path, busy_ticks: int, processes: dict):
    """A /proc with a first /proc/stat line and <pid>/stat files: processes = {pid: (ppid, utime, stime)}."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(f"cpu  {busy_ticks} 0 0 999999 0 0 0 0 0 0\ncpu0 0 0 0 0\n")
    for pid, (ppid, utime, stime) in processes.items():
        (root / str(pid)).mkdir(exist_ok=True)
        fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 10
        (root / str(pid) / "stat").write_text(f"{pid} (python (rank) x) " + " ".join(fields) + "\n")


def test_other_processes_cpu_time_is_the_machines_busy_time_less_this_jobs(tmp_path, monkeypatch):
    me, agent, sibling, stranger = os.getpid(), 999_000, 999_001, 999_002
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # under torchrun: the agent and the other ranks are the job
    # the agent is this process's parent; not the real one, which is init (pid 1, the stranger's parent too) when
    # the tests run detached from the shell that started them
    monkeypatch.setattr(metrics.os, "getppid", lambda: agent)
    monkeypatch.setattr(metrics, "_clock_ticks", lambda: 100)
    monkeypatch.setattr(metrics, "PROC", tmp_path / "proc")
    fake_proc(tmp_path / "proc", 1000, {me: (agent, 100, 0), agent: (1, 10, 0), sibling: (agent, 100, 0),
                                         stranger: (1, 0, 0)})
    start = sample_machine_load()
    assert {me, agent, sibling} <= start.job_pids and stranger not in start.job_pids
    # One second later: this rank and its sibling used 1 CPU-s each, the machine 3.5 CPU-s in all.
    fake_proc(tmp_path / "proc", 1350, {me: (agent, 150, 50), agent: (1, 10, 0), sibling: (agent, 200, 0),
                                         stranger: (1, 150, 0)})
    end = dataclasses.replace(sample_machine_load(), monotonic_s=start.monotonic_s + 1.0)
    load = machine_load_between(start, end)
    assert load["job_cpu_s"] == pytest.approx(2.0) and load["other_processes_cpu_s"] == pytest.approx(1.5)
    cpus = os.cpu_count()
    assert load["other_processes_cpu_share"] == pytest.approx(1.5 / cpus, abs=1e-3)
    assert load["busy"] == (1.5 / cpus > BUSY_OTHER_CPU_SHARE)
    if load["busy"]:
        assert "other processes used 1.50 CPU-s of the 1.00 s window" in busy_machine_warning(load)


def test_interrupt_and_idle_time_are_their_columns_of_all_cpus(tmp_path, monkeypatch):
    """/proc/stat's first line: user nice system idle iowait irq softirq steal; the interrupt time is irq + softirq,
    the idle time idle + iowait, and both None without /proc/stat."""
    monkeypatch.setattr(metrics, "_clock_ticks", lambda: 100)
    monkeypatch.setattr(metrics, "PROC", tmp_path)
    (tmp_path / "stat").write_text("cpu  500 7 300 99999 11 3 42 13 0 0\ncpu0 0 0 0 0\n")
    assert metrics.interrupt_cpu_seconds() == pytest.approx(0.45)
    assert metrics.idle_cpu_seconds() == pytest.approx(1000.10)
    (tmp_path / "stat").unlink()
    assert metrics.interrupt_cpu_seconds() is None and metrics.idle_cpu_seconds() is None


def test_every_threads_cpu_time_is_read_from_schedstat_and_skips_a_thread_that_ended(tmp_path, monkeypatch):
    """Each /proc/<pid>/task/<tid>/schedstat's first field (ns on a CPU), by thread id; a file that cannot be read
    (the thread ended) is skipped; None where /proc shows no thread."""
    monkeypatch.setattr(metrics, "PROC", tmp_path)
    assert metrics.all_threads_cpu_seconds() is None
    for pid, tid, text in ((1, 1, "1500000000 20 3\n"), (7, 7, "250000000 0 1\n"), (7, 9, "250000000 5 2\n"),
                           (8, 8, "")):
        task = tmp_path / str(pid) / "task" / str(tid)
        task.mkdir(parents=True)
        (task / "schedstat").write_text(text)
    assert metrics.all_threads_cpu_seconds() == pytest.approx({1: 1.5, 7: 0.25, 9: 0.25})


def test_threads_time_in_a_window_counts_new_threads_whole_and_leaves_out_ended_ones():
    before = {1: 10.0, 2: 5.0, 3: 100.0, 4: 7.0}
    # 1 ran 0.5 s, 2 nothing, 3 ended (its 100 s are not taken off), 5 started and ran 0.25 s, and 4's id now
    # belongs to a new thread that ran 0.125 s
    after = {1: 10.5, 2: 5.0, 4: 0.125, 5: 0.25}
    assert metrics.threads_cpu_seconds_between(before, after) == pytest.approx(0.875)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")
def test_every_threads_cpu_time_on_this_machine_grows_with_this_threads_work():
    # threads of other processes that end in the window (another test's subprocesses) take nothing off
    before = metrics.all_threads_cpu_seconds()
    spent = time.thread_time()
    while time.thread_time() - spent < 0.2:
        pass
    assert metrics.threads_cpu_seconds_between(before, metrics.all_threads_cpu_seconds()) >= 0.19


def test_load_on_this_machine_is_measured_and_an_idle_window_gives_no_warning():
    start = sample_machine_load()
    time.sleep(0.05)
    load = machine_load_between(start, sample_machine_load())
    assert load["window_s"] >= 0.05 and load["cpus"] >= 1
    assert set(load) >= {"load_average_start", "load_average_end", "other_processes_cpu_s", "busy"}
    quiet = dict(load, busy=False)
    assert busy_machine_warning(quiet) is None


def test_without_proc_the_load_average_decides(monkeypatch, tmp_path):
    monkeypatch.setattr(metrics, "PROC", tmp_path / "no-proc")
    start = sample_machine_load()
    load = machine_load_between(start, sample_machine_load())
    assert load["other_processes_cpu_s"] is None
    overloaded = dict(load, busy=True, load_average_end=(64.0, 1.0, 1.0))
    assert "load average 64.0 on" in busy_machine_warning(overloaded)
