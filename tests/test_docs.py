"""The documentation's commands: each one in a README or docs/ shell block runs here and succeeds, or is listed as not runnable."""
from __future__ import annotations

import gzip
import importlib.metadata
import json
import os
import re
import shutil
import site
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml
from conftest import require_astra_sim

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", "zsh"}
BUNDLED_TRACES = REPO / "tests" / "data" / "cpu"
# Folders of a working tree that a fresh clone does not have (outputs, environments, caches).
NOT_IN_A_CLONE = {".git", ".venv", "chakra-venv", "outputs", "checkpoints", "logs", "converted", "runs", "wandb",
                  "__pycache__", ".pytest_cache", ".cache", "cache", "tokenizers"}


# ---------------------------------------------------------------------------------------------------------
# Reading the commands out of the Markdown
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Command:
    """One shell command shown in a doc: `key` identifies it in the lists below, `text` is what bash runs."""

    path: Path
    line: int
    key: str
    text: str

    @property
    def where(self) -> str:
        path = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{path}:{self.line}"


FENCE_RE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)")
HEREDOC_RE = re.compile(r"<<-?[ \t]*(?P<quote>['\"]?)(?P<word>\w+)(?P=quote)")


def shell_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first content line number, language, lines) of every fenced block; fences inside lists keep their indent."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = FENCE_RE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = match.group("indent"), match.group("fence"), match.group("lang").lower()
        body, i = [], i + 1
        start = i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        blocks.append((start, lang, body))
        i += 1
    return blocks


def _scan_line(line: str, quote: str) -> tuple[str, str, bool]:
    """Bash's quoting over one line: (the code without a trailing comment, the quote still open, ends in '\\')."""
    i = 0
    while i < len(line):
        c = line[i]
        if quote == "'":
            if c == "'":
                quote = ""
        elif quote == '"':
            if c == "\\":
                i += 1
            elif c == '"':
                quote = ""
        elif c in "'\"":
            quote = c
        elif c == "\\":
            if i == len(line) - 1:
                return line[:i], quote, True
            i += 1
        elif c == "#" and (i == 0 or line[i - 1] in " \t;&|("):
            return line[:i].rstrip(), quote, False
        i += 1
    return line, quote, False


def split_commands(lines: list[str], first_line: int, console: bool) -> list[tuple[int, str, str]]:
    """(line number, key, text) per command of a block: continuation lines and multi-line quotes joined, comments
    dropped, here-document bodies kept in the text (the key is the command line without the body)."""
    commands, i = [], 0
    while i < len(lines):
        line = lines[i]
        if console:
            if not line.startswith("$ "):
                i += 1  # output shown after a prompt
                continue
            line = line[2:]
        if not line.strip() or line.lstrip().startswith("#"):
            i += 1
            continue
        start, text, quote = i, "", ""
        while True:
            code, quote, continued = _scan_line(line, quote)
            text += code
            i += 1
            if not (continued or quote) or i >= len(lines):
                break
            text += " " if continued else "\n"
            line = lines[i][2:] if console and lines[i].startswith("> ") else lines[i]
        key = " ".join(text.replace("\\\n", " ").split())  # a continuation inside quotes (bash -c '...') too
        heredoc = HEREDOC_RE.search(text)
        if heredoc:
            body = []
            while i < len(lines) and lines[i].strip() != heredoc.group("word"):
                body.append(lines[i])
                i += 1
            i += 1
            text = "\n".join([text, *body, heredoc.group("word")])
        commands.append((first_line + start, key, text))
    return commands


def doc_commands(paths: list[Path] = DOC_FILES) -> list[Command]:
    """Every command of every bash/sh/console block of the README and docs/*.md."""
    found = []
    for path in paths:
        for start, lang, body in shell_blocks(path.read_text(encoding="utf-8")):
            if lang in SHELL_LANGUAGES:
                found += [Command(path, line, key, text)
                          for line, key, text in split_commands(body, start, console=lang == "console")]
    return found


# ---------------------------------------------------------------------------------------------------------
# What each command needs, and what it must leave behind
# ---------------------------------------------------------------------------------------------------------

Check = Callable[[Path, str], None]
Setup = Callable[[Path], None]


@dataclass
class Run:
    """A documented command run as written, in a copy of the repository (see `sandbox`), after `setup`."""

    checks: list[Check] = field(default_factory=list)
    setup: list[Setup] = field(default_factory=list)
    slow: bool = False
    timeout: int = 300
    # A documented command (setup_and_convert.sh) this one follows: run first as after the main job (.venv, no
    # chakra-venv/), then this one with python3 the Python that command's last line names.
    after: str = ""


def files(*patterns: str) -> Check:
    def check(root: Path, output: str) -> None:
        for pattern in patterns:
            assert list(root.glob(pattern)), f"no {pattern} after the command; output:\n{output[-3000:]}"
    return check


def says(*texts: str) -> Check:
    def check(root: Path, output: str) -> None:
        for text in texts:
            assert text in output, f"{text!r} not in the output:\n{output[-3000:]}"
    return check


def no_files(*patterns: str) -> Check:
    def check(root: Path, output: str) -> None:
        for pattern in patterns:
            assert not list(root.glob(pattern)), f"{pattern} should not exist after the command"
    return check


def run_in(root: Path, *argv: str) -> None:
    subprocess.run([sys.executable, *argv, "--no-progress"], cwd=root, check=True, capture_output=True,
                   env=command_env(root))


def no_outputs(root: Path) -> None:
    """A fresh clone has no outputs/."""
    shutil.rmtree(root / "outputs")


def converted(root: Path) -> None:
    run_in(root, "convert_to_et.py", "outputs")


def converted_with_merged_json(root: Path) -> None:
    run_in(root, "convert_to_et.py", "outputs/bert_tiny_2r", "--emit-merged")


def rank_1_et_lost(root: Path) -> None:
    """After a conversion, one rank's .et is gone (as after a failed rank): convert_remaining.py redoes only it."""
    converted(root)
    (root / "outputs/bert_tiny_2r/bert_tiny_2r.1.et").unlink()
    os.utime(root / "outputs/bert_tiny_2r/bert_tiny_2r.0.et", (1_000_000_000, 1_000_000_000))


def rank_1_et_lost_from_converted(root: Path) -> None:
    """The README's sequence: a conversion into converted/, then one rank's .et there gone (as after a failed rank)."""
    run_in(root, "convert_to_et.py", "outputs", "--output-dir", "converted")
    (root / "converted/bert_tiny_2r/bert_tiny_2r.1.et").unlink()
    os.utime(root / "converted/bert_tiny_2r/bert_tiny_2r.0.et", (1_000_000_000, 1_000_000_000))


def only_the_lost_rank_redone_in_converted(root: Path, output: str) -> None:
    assert (root / "converted/bert_tiny_2r/bert_tiny_2r.1.et").is_file()
    assert (root / "converted/bert_tiny_2r/bert_tiny_2r.0.et").stat().st_mtime == 1_000_000_000, \
        "convert_remaining.py converted a rank that was already done"
    assert not list((root / "outputs").glob("*/*.et")), "convert_remaining.py converted into the trace folders"


def host_trace_written_twice(root: Path) -> None:
    """The seed's broken host trace: the observer wrote the document twice into one file."""
    folder = root / "outputs" / "gpt2_tiny_1r"
    document = gzip.decompress((folder / "host.0.json.gz").read_bytes())
    (folder / "host.0.json.gz").unlink()
    (folder / "host.0.json").write_bytes(document + b"\n" + document)


def doc_command_ran(key: str) -> Setup:
    """An earlier command of the same doc, run first (the files it writes are what this one builds on)."""
    def setup(root: Path) -> None:
        command = next(c for c in doc_commands() if c.key == key)
        subprocess.run(["bash", "-c", command.text], cwd=root, check=True, env=command_env(root))
    return setup


def untouched_et(root: Path, output: str) -> None:
    assert (root / "outputs/bert_tiny_2r/bert_tiny_2r.0.et").stat().st_mtime == 1_000_000_000, \
        "convert_remaining.py converted a rank that was already done"


def astra_configs_describe_the_two_rank_run(root: Path, output: str) -> None:
    system = json.loads((root / "astra-configs/system.json").read_text())
    assert system["roofline-enabled"] == 0 and system["all-reduce-implementation"] == ["ring"]
    assert json.loads((root / "astra-configs/remote_memory.json").read_text()) == {"memory-type": "NO_MEMORY_EXPANSION"}
    network = yaml.safe_load((root / "astra-configs/network.yml").read_text())
    ranks = len(list((root / "outputs/bert_tiny_2r").glob("host.*.json*")))
    npus = 1
    for count in network["npus_count"]:
        npus *= count
    assert npus == ranks == 2, f"network has {npus} NPUs for a run of {ranks} ranks"
    assert len(network["bandwidth"]) == len(network["latency"]) == len(network["npus_count"])


def astra_sim_built(root: Path) -> None:
    """The commands that run ASTRA-sim need $ASTRA_SIM (./install_astra_sim.sh)."""
    require_astra_sim()


def astra_configs_written(root: Path) -> None:
    (root / "astra-configs").mkdir()
    for key in ("cat > astra-configs/system.json <<'EOF'", "cat > astra-configs/network.yml <<'EOF'",
                "cat > astra-configs/remote_memory.json <<'EOF'"):
        doc_command_ran(key)(root)


def trace_folder(run: str, ranks: int) -> list[Check]:
    per_rank = [f"outputs/{run}/{kind}.{r}.json" for r in range(ranks) for kind in ("host", "device")]
    return [files(*per_rank, f"outputs/{run}/stacks.0.txt", f"outputs/{run}/run.json")]


def converted_run(folder: str, name: str, ranks: int) -> Check:
    return files(*[f"{folder}/{name}.{r}.et" for r in range(ranks)], f"{folder}/CONVERSION_SUMMARY.md")


def profiling_outputs() -> list[Check]:
    """What ./run_all_profiling.sh leaves on a machine without a GPU: 1 and 2 CPU ranks (1 on a one-core machine)."""
    counts = [1, 2] if (os.cpu_count() or 1) >= 2 else [1]
    checks = []
    for model in ("gpt2", "bert"):
        for n in counts:
            run = f"{model}_{n}cpu_quick_trace"
            checks += trace_folder(run, n) + [converted_run(f"outputs/{run}", run, n), times_steps_after_window(run)]
    return checks + [says("Conversion to Chakra .et")]


def times_steps_after_window(run: str) -> Check:
    """run.json records untraced steps after the traced ones, as many as before them (the tracer's default): the
    untraced median the .et is corrected towards is not only the run's first steps."""
    def check(root: Path, output: str) -> None:
        info = json.loads((root / "outputs" / run / "run.json").read_text())
        wait, last_traced = info["schedule"]["wait"], max(info["traced_steps"])
        after = [step for step in info["untraced_steps"] if step > last_traced]
        assert len(after) == wait, f"{run}: untraced steps {info['untraced_steps']} after traced {info['traced_steps']}"
    return check


SCALE_SOURCE = "mkdir -p outputs && cp -r tests/data/cpu/gpt2_tiny_2r outputs/ && ./setup_and_convert.sh outputs/gpt2_tiny_2r"


def scaled_set(folder: str, name: str, ranks: int) -> Check:
    return files(f"{folder}/{name}.0.et", f"{folder}/{name}.{ranks - 1}.et", f"{folder}/SCALE_SUMMARY.md")


def network_has_npus(path: str, npus: int) -> Check:
    def check(root: Path, output: str) -> None:
        network = yaml.safe_load((root / path).read_text())
        count = 1
        for n in network["npus_count"]:
            count *= n
        assert count == npus, f"{path} has {count} NPUs, not {npus}"
    return check


CONVERTED_BUNDLED = [converted_run("outputs/bert_tiny_2r", "bert_tiny_2r", 2),
                     converted_run("outputs/gpt2_tiny_1r", "gpt2_tiny_1r", 1)]
MANUAL_TRACE = [*trace_folder("bert_manual_2cpu", 2), files("checkpoints/bert_manual_2cpu/final_model/config.json")]
OWN_LOOP = ("torchrun --standalone --nproc_per_node=2 examples/own_training_loop.py --enable-tracing "
            "--trace-output-dir outputs")


def own_loop_converted(root: Path) -> None:
    doc_command_ran(OWN_LOOP)(root)
    run_in(root, "convert_to_et.py", "outputs/mlp_2r")

# Commands run by this file, as the docs show them.
RUN: dict[str, Run] = {
    # README.md
    "./run_all_profiling.sh": Run(profiling_outputs(), slow=True, timeout=900),
    "./setup_and_convert.sh": Run([*CONVERTED_BUNDLED, says("==> Done")]),
    "source .venv/bin/activate": Run([]),
    "mkdir -p outputs && cp -r tests/data/cpu/bert_tiny_2r outputs/":
        Run([files("outputs/bert_tiny_2r/host.1.json.gz", "outputs/bert_tiny_2r/device.1.json.gz")],
            setup=[no_outputs]),
    "./setup_and_convert.sh outputs/bert_tiny_2r":
        Run([CONVERTED_BUNDLED[0], no_files("outputs/gpt2_tiny_1r/*.et"), says("==> Done")]),
    "./fix_host_traces.py --check outputs": Run([says("already valid")]),
    "./fix_host_traces.py outputs":
        Run([says("repaired: outputs/gpt2_tiny_1r/host.0.json"), files("outputs/gpt2_tiny_1r/host.0.json.orig")],
            setup=[host_trace_written_twice]),
    "python3 convert_to_et.py outputs --output-dir converted --jobs 2 --emit-merged":
        Run([converted_run("converted/bert_tiny_2r", "bert_tiny_2r", 2),
             converted_run("converted/gpt2_tiny_1r", "gpt2_tiny_1r", 1),
             files("converted/bert_tiny_2r/bert_tiny_2r.1.merged.json")]),
    "python3 convert_remaining.py outputs --output-dir converted":
        Run([only_the_lost_rank_redone_in_converted], setup=[rank_1_et_lost_from_converted]),
    "python3 trace_report.py outputs/bert_tiny_2r":
        Run([files("outputs/bert_tiny_2r/report.md", "outputs/bert_tiny_2r/report_breakdown.png")],
            setup=[converted]),
    "torchrun --standalone --nproc_per_node=2 bert/train.py --model-name tiny --max-seq-length 128 --num-gpus 2 "
    "--enable-tracing --trace-name bert_manual_2cpu --save-dir checkpoints/bert_manual_2cpu":
        Run(MANUAL_TRACE, slow=True),
    # docs/USAGE_GUIDE.md
    OWN_LOOP: Run(trace_folder("mlp_2r", 2), slow=True),
    "python3 convert_to_et.py outputs/mlp_2r":
        Run([converted_run("outputs/mlp_2r", "mlp_2r", 2), says("the .et durations estimate the untraced step")],
            setup=[doc_command_ran(OWN_LOOP)], slow=True),
    "python3 simulate.py outputs/mlp_2r --bandwidth 10Gbit/s":
        Run([files("outputs/mlp_2r/SIMULATION.md"), says("Ring of 2 NPUs, 10 Gbit/s", "predicted step:")],
            setup=[astra_sim_built, own_loop_converted], slow=True),
    "./build.sh --dry-run": Run([says("docker build", "-t mosim-llms:latest")]),
    "./run.sh gpu --dry-run": Run([says("docker run", "--gpus all", "/outputs:/workspace/mosim-llms/outputs")]),
    "./run_gpt2.sh 8 4 --dry-run": Run([says("dry run")]),
    "./run_all_profiling.sh --dry-run": Run([says("dry run", "convert_to_et.py")]),
    # docs/CHAKRA_SETUP.md
    "python3 --version": Run([says("Python 3.")]),
    "./setup_and_convert.sh --jobs 1 outputs": Run([*CONVERTED_BUNDLED, says("--jobs 1")]),
    "./setup_and_convert.sh -- --report":
        Run([*CONVERTED_BUNDLED, files("outputs/bert_tiny_2r/report.md", "outputs/gpt2_tiny_1r/report_breakdown.png")]),
    "./setup_and_convert.sh outputs/bert_tiny_2r -- --emit-merged --output-dir converted":
        Run([files("converted/bert_tiny_2r.0.et", "converted/bert_tiny_2r.1.merged.json")]),
    "./install_chakra_tools.sh": Run([says("Reusing", "Conversion environment ready")]),
    "./install_chakra_tools.sh --with-report": Run([says("Reusing", "Conversion environment ready")]),
    "chakra-venv/bin/python fix_host_traces.py --check outputs": Run([says("already valid")]),
    "chakra-venv/bin/python fix_host_traces.py outputs":
        Run([says("repaired:"), files("outputs/gpt2_tiny_1r/host.0.json.orig")], setup=[host_trace_written_twice]),
    "chakra-venv/bin/python convert_to_et.py outputs": Run(CONVERTED_BUNDLED),
    "chakra-venv/bin/python convert_remaining.py outputs":
        Run([files("outputs/bert_tiny_2r/bert_tiny_2r.1.et"), untouched_et], setup=[rank_1_et_lost]),
    "chakra-venv/bin/python trace_report.py outputs/bert_tiny_2r":
        Run([files("outputs/bert_tiny_2r/report.md", "outputs/bert_tiny_2r/report.json")], setup=[converted]),
    "chakra-venv/bin/python convert_to_et.py outputs/bert_tiny_2r --emit-merged":
        Run([files("outputs/bert_tiny_2r/bert_tiny_2r.0.merged.json", "outputs/bert_tiny_2r/bert_tiny_2r.1.et")]),
    "chakra-venv/bin/chakra_converter PyTorch --input outputs/bert_tiny_2r/bert_tiny_2r.0.merged.json "
    "--output outputs/chakra_official.0.et":
        Run([files("outputs/chakra_official.0.et")], setup=[converted_with_merged_json]),
    "mkdir -p astra-configs": Run([files("astra-configs")]),
    "cat > astra-configs/system.json <<'EOF'": Run([files("astra-configs/system.json")],
                                                   setup=[lambda root: (root / "astra-configs").mkdir()]),
    "cat > astra-configs/network.yml <<'EOF'":
        Run([astra_configs_describe_the_two_rank_run],
            setup=[lambda root: (root / "astra-configs").mkdir(), doc_command_ran("cat > astra-configs/system.json <<'EOF'"),
                   doc_command_ran("cat > astra-configs/remote_memory.json <<'EOF'")]),
    "cat > astra-configs/remote_memory.json <<'EOF'": Run([files("astra-configs/remote_memory.json")],
                                                          setup=[lambda root: (root / "astra-configs").mkdir()]),
    "python3 simulate.py outputs/bert_tiny_2r --bandwidth 2Gbit/s":
        Run([files("outputs/bert_tiny_2r/SIMULATION.md", "outputs/bert_tiny_2r/astra-sim/network.yml"),
             says("Ring of 2 NPUs, 2 Gbit/s", "predicted step:")], setup=[astra_sim_built, converted]),
    "python3 simulate.py outputs/bert_tiny_2r --bandwidth 100Mbit/s --latency 1000 --topology Switch "
    "--collective direct":
        Run([files("outputs/bert_tiny_2r/SIMULATION.md"), says("Switch of 2 NPUs, 100 Mbit/s", "predicted step:")],
            setup=[astra_sim_built, converted]),
    '"$ASTRA_SIM" --workload-configuration=outputs/bert_tiny_2r/bert_tiny_2r '
    "--system-configuration=astra-configs/system.json --network-configuration=astra-configs/network.yml "
    "--remote-memory-configuration=astra-configs/remote_memory.json":
        Run([says("sys[0] finished", "sys[1] finished")], setup=[astra_sim_built, converted, astra_configs_written]),
    # README.md and docs/CHAKRA_SETUP.md: scale-out
    SCALE_SOURCE: Run([converted_run("outputs/gpt2_tiny_2r", "gpt2_tiny_2r", 2), says("==> Done")]),
    "python3 scale_et.py outputs/gpt2_tiny_2r --ranks 1024":
        Run([scaled_set("outputs/gpt2_tiny_2r_1024npus", "gpt2_tiny_2r_1024npus", 1024),
             says("wrote 1024 ranks from 2 traced: 2 files, 1022 hard links")], after=SCALE_SOURCE),
    "python3 scale_et.py outputs/gpt2_tiny_2r --ranks 1024 --slow 3:1.5":
        Run([scaled_set("outputs/gpt2_tiny_2r_1024npus", "gpt2_tiny_2r_1024npus", 1024),
             says("wrote 1024 ranks from 2 traced: 3 files, 1021 hard links")], after=SCALE_SOURCE),
    # docs/TRAINING.md
    "python gpt2/train.py --model-name tiny --max-steps 20 --save-dir checkpoints/smoke-gpt2":
        Run([files("checkpoints/smoke-gpt2/final_model/config.json"), says("done: 20 steps")], slow=True),
    "torchrun --nproc_per_node=2 bert/train.py --model-name tiny --max-steps 20 --save-dir checkpoints/smoke-bert":
        Run([files("checkpoints/smoke-bert/final_model/config.json"), says("weights identical on all 2 ranks")],
            slow=True),
}

# Commands another part of the suite (or CI) runs: (file, text that must be in it).
RUN_ELSEWHERE: dict[str, tuple[str, str]] = {
    "./run_tests.sh": (".ci/run", "exec ./run_tests.sh"),  # running the suite from inside the suite would recurse
    # docs/MULTINODE.md "Trying it on one machine": the two launchers, the wait and the listing are one sequence
    "./run_bert_quick.sh --cpu --num-gpus 1 --max-steps 4 --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 "
    "--master-port 29511 --logs-dir logs/node0 &":
        ("tests/test_launchers.py", "def test_two_nodes_on_one_machine_share_one_trace_folder"),
    "./run_bert_quick.sh --cpu --num-gpus 1 --max-steps 4 --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 "
    "--master-port 29511 --logs-dir logs/node1":
        ("tests/test_launchers.py", "def test_two_nodes_on_one_machine_share_one_trace_folder"),
    "wait": ("tests/test_launchers.py", "def test_two_nodes_on_one_machine_share_one_trace_folder"),
    "ls outputs/bert_2cpu_quick_trace/":
        ("tests/test_launchers.py", "def test_two_nodes_on_one_machine_share_one_trace_folder"),
}

DOCKER = "needs a Docker engine (and, for gpu, the NVIDIA container toolkit); ./build.sh --dry-run and ./run.sh gpu --dry-run run instead"
GPUS = "needs GPUs: the GPU runs of GPT-2 124M / BERT-base it shows; without a GPU the launchers fall back to the CPU runs that ./run_all_profiling.sh runs here"
FULL_TRAINING = "full training (3 epochs of GPT-2 124M or BERT-base, hours) on GPUs, started in the background"
CLUSTER = "needs several nodes (or a Slurm cluster) reachable from each other"
SERVER = "needs the GPU server (ssh access) to copy from"
NETWORK = "needs the network (PyPI, download.pytorch.org or GitHub)"

BENCHMARK = "the full benchmark takes 10 to 40 minutes here; tests/test_bench.py runs each benchmark with --quick"

NOT_RUNNABLE: dict[str, str] = {
    "python3 simulate.py outputs/gpt2_tiny_2r --ranks 1024 --bandwidth 100Gbit/s":
        "ASTRA-sim itself takes about 26 minutes for 1024 NPUs on 2 cores (docs/BENCHMARKS.md); "
        "tests/test_simulate.py runs the same --ranks path on 8 NPUs where $ASTRA_SIM is built",
    # docs/BENCHMARKS.md
    "python bench/train_bench.py --threads 1": BENCHMARK,
    "python bench/train_bench.py --repeats 1": GPUS,
    "python bench/process_pace.py --processes 12": "a benchmark of 1.5 min; tests/test_bench.py runs it with --quick",
    "CUDA_VISIBLE_DEVICES= python bench/whatif_bench.py --model gpt2-124m-shape --rates unthrottled,2gbit,1gbit "
    "--traces 3 --cycles 2 --warmup-cycles 0 --after-window-cycles 0 --no-docs --keep /tmp/keep":
        BENCHMARK + " (this one ran on the device machine's 16-core CPU)",
    "python bench/whatif_bench.py --model tiny --trace-rate 400mbit --traces 3 --keep /tmp/k78_tiny400": BENCHMARK,
    "python bench/whatif_bench.py --model bert-tiny --trace-rate 1gbit --traces 3 --keep /tmp/k79_berttiny1g":
        BENCHMARK,
    "python bench/whatif_bench.py --model gpt2-124m-shape --trace-rate 2gbit --traces 3 --keep /tmp/k80_124m2g":
        BENCHMARK,
    "python bench/communication_cpu.py":
        "a benchmark of 1.5 min as root (a rate-limited network namespace); tests/test_bench.py runs it with --quick",
    "python bench/tbf_stalls.py":
        "a benchmark of 3.5 min as root (a rate-limited network namespace); tests/test_bench.py runs one cycle",
    "python bench/pause_cost.py --pause-s 8 --rounds 4":
        "a benchmark of 7 min; tests/test_bench.py runs it with --quick",
    "python bench/pause_cost.py --model tiny --pause-s 0.15 --rounds 6 --steps 20":
        "a benchmark of 2 min; tests/test_bench.py runs the tiny model with one step of each kind",
    "python bench/rate_cpu.py --model tiny --cycles 4":
        "a benchmark of 3 min as root (a rate-limited network namespace); tests/test_bench.py runs it with --quick",
    "python bench/rate_cpu.py --model bert-tiny --cycles 4":
        "a benchmark of 3 min as root (a rate-limited network namespace); tests/test_bench.py runs it with --quick",
    "python bench/whatif_bench.py --model bert-tiny --trace-rate 400mbit --traces 3 --no-docs --keep "
    "/tmp/k81_berttiny400": BENCHMARK,
    "python bench/whatif_bench.py --model tiny --trace-rate 1gbit --traces 3 --no-docs --keep /tmp/k82_tiny1g":
        BENCHMARK,
    "python bench/whatif_bench.py --model tiny --traces 3 --no-docs --keep /tmp/k85_tiny": BENCHMARK,
    "python bench/whatif_bench.py --model bert-tiny --traces 3 --no-docs --keep /tmp/k87_berttiny": BENCHMARK,
    "python bench/whatif_bench.py --model gpt2-124m-shape --traces 3 --no-docs --keep /tmp/k88_124m": BENCHMARK,
    "python bench/whatif_bench.py --model bert-base-shape --trace-rate 2gbit --traces 3 --no-docs --keep "
    "/tmp/k86_bertbase2g": BENCHMARK,
    "python bench/whatif_bench.py --model bert-6x384 --trace-rate 1gbit --traces 3 --no-docs --keep "
    "/tmp/k96_bert6_1g": BENCHMARK,
    "python bench/whatif_repredict.py /tmp/k85_tiny /tmp/k86_bertbase2g /tmp/k87_berttiny /tmp/k88_124m /tmp/k89_tiny "
    "/tmp/k90_berttiny1g /tmp/k91_124m /tmp/k92_mid /tmp/k93_mid1g /tmp/k94_bert6 /tmp/k95_mid400":
        "judges the what-if benchmark's kept runs, which a clone does not have (minutes of tracing as root each)",
    "python bench/rate_cpu.py --model bert-base-shape --rates unthrottled,2gbit --cycles 4":
        "a benchmark of 3 min as root (a rate-limited network namespace); tests/test_bench.py runs it with --quick",
    "python bench/communication_cpu.py --rates unthrottled,1gbit,400mbit,100mbit --mb 0.9 --seconds 3":
        "a benchmark of 1 min as root (a rate-limited network namespace); tests/test_bench.py runs it with --quick",
    "python bench/communication_cpu.py --rates unthrottled,1gbit,400mbit,100mbit --mb 8 --seconds 3":
        "a benchmark of 1 min as root (a rate-limited network namespace); tests/test_bench.py runs it with --quick",
    "python bench/tracing_cost.py --threads 1": BENCHMARK,
    "python bench/convert_bench.py": BENCHMARK,
    # README.md
    "./build.sh": DOCKER,
    "./run.sh gpu": DOCKER,
    "scp -r gpu-server:/path/to/mosim-llms/outputs ./": SERVER,
    "./install_chakra_tools.sh --with-official": NETWORK + " (the official et_replay comes from GitHub)",
    "python3 trace_report.py outputs/gpt2_2cpu_quick_trace":
        "needs the main job's converted runs (minutes of training); the report on a converted run is run here as "
        "python3 trace_report.py outputs/bert_tiny_2r",
    # docs/USAGE_GUIDE.md
    "./run.sh cpu": DOCKER,
    "./run.sh gpu -- ./run_all_profiling.sh": DOCKER,
    "docker-compose up -d": DOCKER,
    "docker-compose exec mosim-llms bash": DOCKER,
    "docker-compose down": DOCKER,
    "pip install torch==2.4.0 --index-url https://download.pytorch.org/whl/cu124": NETWORK,
    "pip install -r requirements.txt -r requirements-report.txt": NETWORK,
    "pip install --no-deps -r requirements-convert.txt": NETWORK,
    "./run_gpt2_quick.sh": GPUS,
    "./run_bert_quick.sh": GPUS,
    "./run_gpt2.sh 1 4": FULL_TRAINING,
    "./run_bert.sh 2 4": FULL_TRAINING,
    "./run_gpt2.sh 8 4": FULL_TRAINING,
    "./run_all_experiments.sh": FULL_TRAINING,
    "tail -f logs/training_console.log": "follows the log of a running background training until interrupted",
    'ps -p "$(cat logs/training.pid)"': "needs a background training run in progress",
    'kill "$(cat logs/training.pid)"': "needs a background training run in progress",
    "python3 gpt2/train.py --model-name gpt2 --batch-size 4 --num-gpus 1 --precision bf16 --enable-tracing "
    "--trace-output-dir ./outputs --trace-name gpt2_custom --save-dir ./checkpoints/gpt2_custom":
        GPUS + " (bf16 GPT-2 124M)",
    "torchrun --nproc_per_node=8 gpt2/train.py --model-name gpt2 --batch-size 4 --learning-rate 5e-5 --num-epochs 3 "
    "--num-gpus 8 --precision bf16 --compile --save-dir ./checkpoints/gpt2": FULL_TRAINING + "; 8 GPUs",
    "torchrun --nproc_per_node=8 bert/train.py --model-name bert-base-uncased --batch-size 4 --num-gpus 8 "
    "--enable-tracing --trace-name bert_8gpu_custom --save-dir ./checkpoints/bert_8gpu_custom": GPUS + " (8 of them)",
    "./run_gpt2.sh 1 2 -- --gradient-accumulation-steps 2": FULL_TRAINING,
    "./run_gpt2.sh 1 4 --max-seq-length 256": FULL_TRAINING,
    "./run_gpt2.sh 1 4 --model-name gpt2": FULL_TRAINING,
    "NCCL_DEBUG=INFO NCCL_P2P_DISABLE=1 ./run_gpt2.sh 8 4 --foreground": FULL_TRAINING + "; NCCL needs GPUs",
    "./run_gpt2.sh 1 4 -- --cache-dir ./data/cache": FULL_TRAINING + "; the download needs the network",
    "./run_gpt2.sh 1 4 --dataset-path data/my_squad.json": FULL_TRAINING + "; data/my_squad.json is the reader's own file",
    "./run_gpt2_quick.sh --num-gpus 2 -- --trace-wait-steps 5 --trace-warmup-steps 2 --trace-active-steps 3": GPUS,
    "./run_gpt2.sh 2 8 --precision bf16 --compile -- --attn-implementation flash_attention_2":
        FULL_TRAINING + "; flash_attention_2 needs a GPU and the flash-attn package",
    "python3 gpt2/train.py --model-name gpt2 --num-gpus 1 --max-steps 20": GPUS + " (GPT-2 124M at 512 tokens)",
    "torchrun --nproc_per_node=2 gpt2/train.py --model-name gpt2 --num-gpus 2 --max-steps 20": GPUS,
    "TORCH_DISTRIBUTED_DEBUG=DETAIL NCCL_DEBUG=INFO torchrun --nproc_per_node=2 gpt2/train.py --model-name gpt2 "
    "--num-gpus 2 --max-steps 20": GPUS + "; NCCL needs GPUs",
    # docs/CHAKRA_SETUP.md
    "xcode-select --install": "macOS only, and it downloads the command line tools",
    "sudo apt-get install -y python3 python3-venv": "needs root and the Debian package mirrors",
    "rsync -a gpu-server:/path/to/mosim-llms/outputs/ outputs/": SERVER,
    "sudo apt-get install -y git cmake g++ protobuf-compiler libprotobuf-dev":
        "needs root and the Debian package mirrors",
    "./install_astra_sim.sh": NETWORK + " (it clones ASTRA-sim from GitHub) and builds for 10-20 minutes; "
        "tests/test_simulate.py runs its --dry-run and its errors",
    "export ASTRA_SIM=~/.local/astra-sim/bin/AstraSim_Analytical_Congestion_Unaware":
        "names the binary ./install_astra_sim.sh builds, which a clone does not have; the commands that run ASTRA-sim "
        "here read $ASTRA_SIM and are skipped without it",
    "./install_astra_sim.sh --source ~/astra-sim --yaml-cpp ~/yaml-cpp":
        "needs an ASTRA-sim tree and yaml-cpp in the reader's home, then builds for 10-20 minutes; "
        "tests/test_simulate.py runs --source with --dry-run on a tree that needs both fixes",
    # docs/MULTINODE.md
    "./run_gpt2_quick.sh --num-gpus 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500": CLUSTER,
    "./run_gpt2_quick.sh --num-gpus 8 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500": CLUSTER,
    "./run_gpt2_quick.sh --num-gpus 8 --nnodes 2 --node-rank R --master-addr 10.0.0.1 --master-port 29500": CLUSTER,
    "torchrun --nnodes=2 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 --nproc_per_node=8 gpt2/train.py "
    "--model-name gpt2 --num-gpus 16 --batch-size 4 --test --precision bf16 --no-compile --enable-tracing "
    "--trace-output-dir ./outputs --trace-name gpt2_16gpu_quick_trace": CLUSTER,
    "./run.sh gpu --host-network": DOCKER,
    "set -euo pipefail": "line of the Slurm batch script: " + CLUSTER,
    'cd "$SLURM_SUBMIT_DIR"': "line of the Slurm batch script: " + CLUSTER,
    'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"':
        "line of the Slurm batch script: " + CLUSTER,
    "export MASTER_ADDR": "line of the Slurm batch script: " + CLUSTER,
    "srun bash -c './run_gpt2_quick.sh --foreground --num-gpus 8 --nnodes \"$SLURM_NNODES\" --node-rank "
    "\"$SLURM_NODEID\" --master-addr \"$MASTER_ADDR\" --master-port 29500 --logs-dir \"logs/node$SLURM_NODEID\"'":
        "line of the Slurm batch script: " + CLUSTER,
    # docs/TRAINING.md
    "torchrun --nproc_per_node=8 gpt2/train.py --model-name gpt2 --batch-size 4 --num-epochs 3 --num-gpus 8":
        FULL_TRAINING + "; 8 GPUs",
    "python bert/train.py --model-name bert-base-uncased --batch-size 4 --learning-rate 5e-5 --save-dir ./checkpoints/bert":
        FULL_TRAINING,
    "python gpt2/train.py --model-name tiny --max-steps 2000 --resume-from checkpoints/gpt2/checkpoint-1000":
        "needs checkpoint-1000 of an earlier run and trains 1000 more steps (long); resuming itself is tested in "
        "tests/test_training.py::test_resumed_run_reaches_the_same_step_loss_and_weights_as_the_uninterrupted_one",
}


# ---------------------------------------------------------------------------------------------------------
# The lists must match the docs exactly
# ---------------------------------------------------------------------------------------------------------

def unlisted(commands: list[Command]) -> list[Command]:
    listed = set(RUN) | set(RUN_ELSEWHERE) | set(NOT_RUNNABLE)
    return [c for c in commands if c.key not in listed]


def test_every_doc_command_is_run_here_or_listed_as_not_runnable():
    unlisted_commands = unlisted(doc_commands())
    assert not unlisted_commands, ("commands in the docs that tests/test_docs.py neither runs nor lists as not runnable; add "
                          "each to RUN (with what it must leave behind) or to NOT_RUNNABLE (with why):\n"
                          + "\n".join(f"  {c.where}: {c.key}" for c in unlisted_commands))


def test_a_command_added_to_a_doc_is_caught_until_it_is_listed(tmp_path):
    doc = tmp_path / "NEW.md"
    doc.write_text("Run this:\n\n```bash\n./setup_and_convert.sh   # listed\n./new_tool.sh --fast\n```\n")
    assert [(c.where, c.key) for c in unlisted(doc_commands([doc]))] == [(f"{doc}:5", "./new_tool.sh --fast")]


def test_the_lists_name_only_commands_the_docs_show():
    shown = {c.key for c in doc_commands()}
    stale = [key for key in [*RUN, *RUN_ELSEWHERE, *NOT_RUNNABLE] if key not in shown]
    assert not stale, "listed in tests/test_docs.py but no longer in any doc:\n" + "\n".join(f"  {k}" for k in stale)


def test_a_command_is_in_one_list_only_and_every_exception_says_why():
    lists = [set(RUN), set(RUN_ELSEWHERE), set(NOT_RUNNABLE)]
    for i, a in enumerate(lists):
        for b in lists[i + 1:]:
            assert not a & b, f"in two lists: {sorted(a & b)}"
    assert all(len(reason) > 20 for reason in NOT_RUNNABLE.values())


@pytest.mark.parametrize("key", sorted(RUN_ELSEWHERE))
def test_commands_run_elsewhere_are_really_run_there(key):
    path, text = RUN_ELSEWHERE[key]
    assert text in (REPO / path).read_text(encoding="utf-8"), f"{path} does not contain {text!r}"


def test_the_extractor_joins_continuations_quotes_and_here_documents_and_drops_comments():
    markdown = "\n".join([
        "```bash",
        "# a comment",
        "./a.sh --x 1 \\",
        "    --y 2   # trailing comment",
        "echo 'one # not a comment",
        "two'",
        "cat > f.txt <<'EOF'",
        "body # kept",
        "EOF",
        "```",
        "```console",
        "$ ./b.sh",
        "output line",
        "```",
        "```text",
        "./not-a-command.sh",
        "```",
    ])
    commands = [(key, text) for start, lang, body in shell_blocks(markdown) if lang in SHELL_LANGUAGES
                for _, key, text in split_commands(body, start, console=lang == "console")]
    assert [key for key, _ in commands] == ["./a.sh --x 1 --y 2", "echo 'one # not a comment two'",
                                            "cat > f.txt <<'EOF'", "./b.sh"]
    assert commands[2][1] == "cat > f.txt <<'EOF'\nbody # kept\nEOF"


def test_readme_starts_with_the_two_fresh_machine_commands():
    first = shell_blocks((REPO / "README.md").read_text(encoding="utf-8"))[0]
    assert [key for _, key, _ in split_commands(first[2], first[0], console=False)] == \
        ["./run_all_profiling.sh", "./run_tests.sh"]


def test_readme_commands_name_no_chakra_venv():
    """README's commands follow the main job, which leaves .venv and no chakra-venv/ (setup_and_convert.sh then uses
    .venv): `chakra-venv/bin/python scale_et.py ...` after it was exit 127."""
    assert [c.key for c in doc_commands([REPO / "README.md"]) if "chakra-venv/" in c.key] == []


def test_every_table_separator_row_follows_its_header_row():
    """A table pasted into BENCHMARKS.md had left five lone separator rows above its header, twice: Markdown shows
    them as rows of dashes."""
    separator = re.compile(r"^\|[-:|\s]+\|$")
    lone = []
    for doc in DOC_FILES:
        lines = doc.read_text(encoding="utf-8").splitlines()
        lone += [f"{doc.name}:{i + 1}" for i, line in enumerate(lines) if separator.match(line)
                 and (i == 0 or not lines[i - 1].startswith("|") or separator.match(lines[i - 1]))]
    assert lone == []


def test_docs_link_only_to_files_that_exist():
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if not re.match(r"[a-z]+:", target):
                assert (path.parent / target).exists(), f"{path.relative_to(REPO)} links to missing {target}"


# ---------------------------------------------------------------------------------------------------------
# Running them
# ---------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command_env(root: Path) -> dict[str, str]:
    """The environment of a documented command: this interpreter as python/python3, the sandbox's .venv for the
    launchers (PYTHON; they install the sandbox into it, not into the environment running these tests), offline,
    one thread per process, and torchrun's default port moved off 29500 (other runs may hold it)."""
    env = dict(os.environ)
    for name in ("CHAKRA_VENV", "CHAKRA_PYTHON", "VIRTUAL_ENV"):
        env.pop(name, None)
    bin_dir, venv_bin = root.parent / "bin", root / ".venv" / "bin"
    env.update({
        "PATH": os.pathsep.join([str(bin_dir), str(venv_bin), str(Path(sys.executable).parent), env.get("PATH", "")]),
        "PYTHON": str(venv_bin / "python"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline", "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1",
        "PET_MASTER_PORT": str(free_port()),
    })
    return env


def clone_files() -> list[Path]:
    """The files a clone of the working tree has: git's list (tracked and not ignored), else a walk."""
    if shutil.which("git") and (REPO / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, check=True).stdout.decode().split("\0")
        return [Path(p) for p in listed if p and (REPO / p).is_file()]
    return [p.relative_to(REPO) for p in REPO.rglob("*")
            if p.is_file() and not NOT_IN_A_CLONE & set(p.relative_to(REPO).parts[:-1])]


@pytest.fixture(scope="session")
def chakra_venv(tmp_path_factory) -> Path:
    """chakra-venv/ as install_chakra_tools.sh leaves it, made offline: a venv that sees this interpreter's
    packages, filled by the script (pip then has next to nothing to fetch), with the chakra_* commands pip would
    have put in its bin/."""
    venv = tmp_path_factory.mktemp("chakra") / "chakra-venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    env = dict(os.environ)
    env.pop("CHAKRA_VENV", None)
    # --with-report: the reader who makes reports by hand has run ./setup_and_convert.sh -- --report (or this) first
    subprocess.run([str(REPO / "install_chakra_tools.sh"), "--venv", str(venv), "--with-report"], check=True,
                   capture_output=True, env=env)
    for entry in importlib.metadata.entry_points(group="console_scripts"):
        if entry.name.startswith("chakra_"):
            script = venv / "bin" / entry.name
            module, _, attr = entry.value.partition(":")
            script.write_text(f"#!{venv}/bin/python\nimport sys\nfrom {module} import {attr}\n"
                              f"sys.exit({attr}())\n")
            script.chmod(0o755)
    return venv


@pytest.fixture(scope="session")
def sandbox_template(tmp_path_factory, chakra_venv) -> Path:
    """A clone of the working tree as a reader has it when following the docs: chakra-venv/ set up, and the
    bundled traces in outputs/ (as `mkdir -p outputs && cp -r tests/data/cpu/bert_tiny_2r outputs/` leaves them)."""
    root = tmp_path_factory.mktemp("template") / "repo"
    for rel in clone_files():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, root / rel)
    (root / "outputs").mkdir()
    for run in ("bert_tiny_2r", "gpt2_tiny_1r"):
        shutil.copytree(BUNDLED_TRACES / run, root / "outputs" / run)
    (root / "chakra-venv").symlink_to(chakra_venv)
    (root / ".venv").symlink_to(project_venv(tmp_path_factory))
    return root


def project_venv(tmp_path_factory) -> Path:
    """.venv as ./run_tests.sh leaves it, the sandbox's own: a venv that sees the packages of the environment running
    these tests by path, not through its .pth files. The documented commands install the sandbox into .venv
    (editable); into the running environment itself, that would re-point it from this checkout to the sandbox,
    which pytest deletes later."""
    venv = tmp_path_factory.mktemp("project") / ".venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--system-site-packages",
                    "--without-pip", str(venv)], check=True)
    inner = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                           check=True, capture_output=True, text=True).stdout.strip()
    paths = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(inner) / "running_environment.pth").write_text("".join(f"{p}\n" for p in paths))
    return venv


@pytest.fixture
def sandbox(sandbox_template, tmp_path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(sandbox_template, root, symlinks=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):  # a wrapper, not a link: a link to a venv's python would leave the venv
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (bin_dir / name).chmod(0o755)
    return root


def _run_params() -> list:
    return [pytest.param(key, marks=[pytest.mark.slow] if run.slow else [], id=key[:80])
            for key, run in sorted(RUN.items())]


def python_named_after(key: str, root: Path) -> str:
    """Run the documented command `key` in the sandbox as the main job leaves it (.venv, no chakra-venv/), and
    return the line that makes python3 the Python its last line names for the commands that follow."""
    (root / "chakra-venv").unlink()
    command = next(c for c in doc_commands() if c.key == key)
    result = subprocess.run(["bash", "-c", command.text], cwd=root, env=command_env(root), stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command.where}: {key}\n{(result.stdout + result.stderr)[-4000:]}"
    last = result.stdout.splitlines()[-1]
    named = re.fullmatch(r"==> Python for scale_et\.py, simulate\.py and trace_report\.py: \.venv/bin/python "
                         r"\(or python3 after: (source \.venv/bin/activate)\)", last)
    assert named, f"{key}: its last line names no .venv Python for the next commands: {last}"
    prefix = subprocess.run(["bash", "-c", f"{named.group(1)} && python3 -c 'import sys; print(sys.prefix)'"],
                            cwd=root, env=command_env(root), capture_output=True, text=True, check=True).stdout
    assert Path(prefix.strip()) == (root / ".venv").resolve(), f"python3 after {named.group(1)} is {prefix}"
    return named.group(1) + "\n"


@pytest.mark.parametrize("key", _run_params())
def test_documented_command_succeeds(key, sandbox):
    run = RUN[key]
    commands = [c for c in doc_commands() if c.key == key]
    if not commands:
        pytest.fail(f"{key!r} is in RUN but in no doc")
    for setup in run.setup:
        setup(sandbox)
    activate = python_named_after(run.after, sandbox) if run.after else ""
    command = commands[0]
    result = subprocess.run(["bash", "-c", activate + command.text], cwd=sandbox, env=command_env(sandbox),
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=run.timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{command.where}: {key}\nexit {result.returncode}\n{output[-4000:]}"
    for check in run.checks:
        check(sandbox, output)
