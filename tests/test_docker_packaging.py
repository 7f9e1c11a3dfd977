"""Docker packaging: Dockerfile lint and checks, compose file, build.sh and run.sh behaviour, tokenizer download."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
WORKDIR = "/workspace/mosim-llms"
MOUNTED = ("outputs", "data", "checkpoints")
# Folders that are not the project's own scripts (environments made by the launchers or by users).
NOT_PROJECT = {".venv", "venv", "chakra-venv", ".git", "node_modules", "outputs", "checkpoints", "logs"}


def project_tool(name: str) -> str:
    """A test tool from the environment that runs the tests (beside sys.executable), never one found elsewhere on
    the machine: a green run here then means a green run in a stranger's fresh clone."""
    tool = Path(sys.executable).parent / name
    assert tool.exists(), (f"{name} is not in the project's environment ({tool.parent}); ./run_tests.sh installs "
                           "requirements-test.txt into .venv")
    return str(tool)


def shell_scripts() -> list[Path]:
    found = []
    for path in sorted(REPO.rglob("*.sh")):
        if not NOT_PROJECT.intersection(path.relative_to(REPO).parts):
            found.append(path)
    return found


def run(cmd, env=None, timeout=60, **kwargs) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout, **kwargs)


def fake_docker(tmp_path: Path, build_output: str, build_rc: int, info_rc: int = 0) -> Path:
    """A stand-in `docker` for build.sh: this machine has the CLI but no engine to build with."""
    out = tmp_path / "build_output.txt"
    out.write_text(build_output)
    script = tmp_path / "docker"
    script.write_text(f"""#!/usr/bin/env bash
case "$1" in
  info) [ {info_rc} = 0 ] || echo "Cannot connect to the Docker daemon (fake)"; exit {info_rc} ;;
  --version) echo "Docker version 0.0.0-fake" ;;
  build) printf '%s\\n' "$*" > "{tmp_path}/build_args.txt"; cat "{out}"; exit {build_rc} ;;
  image) echo 1234567890 ;;
  *) exit 3 ;;
esac
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


# ---------------------------------------------------------------------------------------------------------
# Dockerfile
# ---------------------------------------------------------------------------------------------------------

def test_hadolint_passes_on_the_dockerfile():
    result = run([project_tool("hadolint"), "Dockerfile"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_has_base_image_argument_workdir_healthcheck_and_tokenizers():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:2\.4\.0-cuda12\.4-cudnn9-runtime$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.search(rf"^WORKDIR {WORKDIR}$", text, re.M)
    assert re.search(r"^HEALTHCHECK ", text, re.M)
    assert "--output-dir /workspace/pretrained_models" in text
    # requirements installed under the constraints of scripts/pip_constraints.py (the base image's torch kept)
    assert re.search(r"python scripts/pip_constraints\.py > /tmp/constraints\.txt", text)
    assert re.search(r"pip install .*-c /tmp/constraints\.txt -r requirements\.txt -r requirements-report\.txt", text)
    # the conversion's packages without mlc-chakra's heavy dependencies (HolisticTraceAnalysis, jupyterlab)
    assert re.search(r"pip install .*--no-deps -c /tmp/constraints\.txt -r requirements-convert\.txt", text)


def test_pip_constraints_pin_the_installed_torch():
    """The image's constraint step, run here: torch stays exactly the version pip sees installed."""
    import importlib.metadata
    result = run([sys.executable, "scripts/pip_constraints.py"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert lines[0] == f"torch=={importlib.metadata.version('torch')}"


@pytest.mark.parametrize("torch_version, expected", [
    ("2.4.0+cu124", ["torch==2.4.0+cu124", "transformers<5"]),  # the default base image
    ("2.5.1", ["torch==2.5.1", "transformers<5"]),
    ("2.6.0+cu126", ["torch==2.6.0+cu126"]),
    ("2.13.0+cpu", ["torch==2.13.0+cpu"]),
])
def test_pip_constraints_cap_transformers_below_torch_2_6(torch_version, expected):
    """transformers 5 switches PyTorch off below 2.6, so older base images get transformers 4."""
    result = run([sys.executable, "scripts/pip_constraints.py", "--torch-version", torch_version])
    assert result.stdout.split() == expected


def dockerfile_build_check() -> str:
    """The Python code of the Dockerfile's build-time check (RUN python -c "import torch, ...")."""
    match = re.search(r'RUN python -c "(import torch,[^"]*)"', (REPO / "Dockerfile").read_text(), re.S)
    assert match, "no import check in the Dockerfile"
    return match.group(1).replace("\\\n", "")


def test_dockerfile_installs_a_compiler_and_its_build_check_compiles_with_torch_compile():
    """GPU runs use --compile: Triton needs a C compiler and inductor a C++ one, which the runtime base image
    lacks; the build must fail when torch.compile cannot compile, not the first training run."""
    text = (REPO / "Dockerfile").read_text()
    apt = re.search(r"apt-get install -y --no-install-recommends ([^\\\n]+)", text).group(1).split()
    assert "g++" in apt  # g++ brings gcc and libc6-dev
    check = dockerfile_build_check()
    assert "torch.compile(" in check and "assert torch.allclose(compiled(x)" in check


def test_dockerfile_import_check_passes_in_a_complete_environment():
    """The build's check, run here with torch.compile standing aside (the slow test below compiles for real): a typo
    in a module name would break every image build."""
    python_code = dockerfile_build_check()
    assert "is_torch_available()" in python_code
    eager = "import torch; torch.compile = lambda function, **options: function; " + python_code
    result = run([sys.executable, "-c", eager])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("torch ") and result.stdout.strip().endswith("| torch.compile ok")


@pytest.mark.slow
def test_dockerfile_build_check_runs_here_with_torch_compile():
    """The whole build check, torch.compile included, on this machine's CPU (inductor needs a C++ compiler)."""
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler on this machine; the image installs g++")
    result = run([sys.executable, "-c", dockerfile_build_check()], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("| torch.compile ok")


def test_files_the_dockerfile_copies_exist_and_are_not_ignored():
    text = (REPO / "Dockerfile").read_text()
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for copy in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for source in copy.split():
            if source == ".":
                continue
            assert (REPO / source).exists(), f"Dockerfile copies {source}, which does not exist"
            assert not any(source == pattern.rstrip("/") or source.startswith(pattern) for pattern in ignored), source


def test_dockerignore_keeps_outputs_checkpoints_venvs_and_caches_out():
    patterns = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    for needed in ("outputs/", "checkpoints/", "logs/", ".venv/", "chakra-venv/", "**/__pycache__/",
                   ".pytest_cache/", "data/cache/", ".git"):
        assert needed in patterns, f".dockerignore lacks {needed}"
    # the bundled dataset and the code stay in the context
    assert "data/" not in patterns and "data" not in patterns


# ---------------------------------------------------------------------------------------------------------
# docker-compose.yml
# ---------------------------------------------------------------------------------------------------------

def test_compose_file_has_the_service_gpus_ipc_volumes_and_environment():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    service = compose["services"]["mosim-llms"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]} in devices
    assert service["ipc"] == "host"
    assert service["working_dir"] == WORKDIR
    volumes = service["volumes"]
    for name in MOUNTED:
        assert f"./{name}:{WORKDIR}/{name}" in volumes
    cache_mounts = [v for v in volumes if v.endswith(":/root/.cache/huggingface")]
    assert cache_mounts, "no HF cache volume"
    cache_volume = cache_mounts[0].split(":")[0]
    assert cache_volume in compose["volumes"], "the HF cache volume is not declared"
    for var in ("WANDB_API_KEY", "HF_TOKEN", "NCCL_DEBUG"):
        assert var in service["environment"]
    assert service["build"]["context"] == "."
    assert "BASE_IMAGE" in service["build"]["args"]


# ---------------------------------------------------------------------------------------------------------
# Shell scripts
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(REPO)))
def test_shellcheck_passes(script):
    result = run([project_tool("shellcheck"), "-x", str(script.relative_to(REPO))])
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_shell_script_is_executable_and_strict():
    for script in shell_scripts():
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash\n"), script
        if script.parent == REPO:  # the top-level commands; the sourced libraries in scripts/ are not run alone
            assert os.access(script, os.X_OK), f"{script.name} is not executable"
            assert "set -euo pipefail" in text, script


# ---------------------------------------------------------------------------------------------------------
# run.sh
# ---------------------------------------------------------------------------------------------------------

def test_run_sh_dry_run_gpu_prints_docker_run_with_all_gpus_and_the_mounts():
    result = run(["./run.sh", "--dry-run", "gpu"])
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip())
    assert argv[:2] == ["docker", "run"]
    assert argv[argv.index("--gpus") + 1] == "all"
    assert "--ipc=host" in argv
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    for name in MOUNTED:
        assert f"{REPO}/{name}:{WORKDIR}/{name}" in mounts
    assert any(m.endswith(":/root/.cache/huggingface") for m in mounts)
    envs = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    assert envs == ["WANDB_API_KEY", "HF_TOKEN", "NCCL_DEBUG"]
    assert argv[argv.index("-w") + 1] == WORKDIR
    assert argv[-2:] == ["mosim-llms:latest", "bash"]


def test_run_sh_shares_the_hf_cache_volume_with_compose():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    volume_name = compose["volumes"]["hf-cache"]["name"]
    result = run(["./run.sh", "cpu", "--dry-run"])
    assert f"{volume_name}:/root/.cache/huggingface" in shlex.split(result.stdout)


def test_run_sh_cpu_has_no_gpus_and_runs_a_given_command():
    result = run(["./run.sh", "cpu", "--dry-run", "--tag", "mine:1", "--", "./run_all_profiling.sh", "--verbose"])
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip())
    assert "--gpus" not in argv and "--network=host" not in argv
    assert argv[-3:] == ["mine:1", "./run_all_profiling.sh", "--verbose"]


def test_run_sh_host_network_for_multi_node_runs():
    argv = shlex.split(run(["./run.sh", "gpu", "--host-network", "--dry-run"]).stdout)
    assert "--network=host" in argv and argv[argv.index("--gpus") + 1] == "all"


@pytest.mark.parametrize("args, message", [
    ([], "say gpu or cpu"),
    (["tpu"], "unknown argument: tpu"),
    (["gpu", "--tag"], "--tag needs a value"),
])
def test_run_sh_bad_arguments_are_one_line_and_exit_2(args, message):
    result = run(["./run.sh", *args])
    assert result.returncode == 2
    assert result.stderr == f"error: {message} (see ./run.sh --help)\n"


def test_run_sh_without_docker_says_so():
    result = run(["./run.sh", "gpu"], env={"DOCKER": "/nonexistent/docker"})
    assert result.returncode == 1
    assert "'/nonexistent/docker' not found; install Docker Engine" in result.stderr


def test_run_sh_gpu_without_nvidia_runtime_says_so(tmp_path):
    docker = fake_docker(tmp_path, "", 0)
    env = {"DOCKER": str(docker), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    if shutil.which("nvidia-container-cli") or shutil.which("nvidia-container-runtime-hook"):
        pytest.skip("this machine has the NVIDIA container toolkit")
    result = run(["./run.sh", "gpu"], env=env)
    assert result.returncode == 1
    assert "the NVIDIA container runtime is missing" in result.stderr
    assert "./run.sh cpu" in result.stderr


# ---------------------------------------------------------------------------------------------------------
# build.sh
# ---------------------------------------------------------------------------------------------------------

def test_build_sh_without_a_docker_engine_exits_nonzero_with_its_message():
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI here; test_build_sh_without_docker_says_so covers that case")
    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        pytest.skip("this machine has a running Docker engine")
    result = run(["./build.sh"])
    assert result.returncode == 1
    assert "✗ Docker build failed at step 1/3: the Docker engine is not reachable" in result.stderr
    assert "successfully" not in result.stdout


def test_build_sh_without_docker_says_so():
    result = run(["./build.sh"], env={"DOCKER": "/nonexistent/docker"})
    assert result.returncode == 1
    assert "'/nonexistent/docker' not found; install Docker Engine" in result.stderr


def test_build_sh_dry_run_prints_the_build_command_with_options():
    result = run(["./build.sh", "--dry-run", "--tag", "me/mosim:2", "--base-image", "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
                  "--no-cache"])
    assert result.returncode == 0, result.stderr
    assert shlex.split(result.stdout.strip()) == [
        "docker", "build", "--build-arg", "BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
        "-t", "me/mosim:2", "--no-cache", "."]


def test_build_sh_default_base_image_is_the_dockerfile_argument():
    result = run(["./build.sh", "--dry-run"])
    default = re.search(r"^ARG BASE_IMAGE=(\S+)$", (REPO / "Dockerfile").read_text(), re.M).group(1)
    assert f"BASE_IMAGE={default}" in shlex.split(result.stdout)


def test_build_sh_names_the_failing_step(tmp_path):
    buildkit_output = "\n".join([
        "#5 [2/7] RUN apt-get update && apt-get install -y --no-install-recommends procps",
        "#5 DONE 12.0s",
        "#7 [4/7] RUN python -c \"import importlib.metadata\" > /tmp/torch-constraint.txt && pip install -r requirements.txt",
        "#7 3.1 ERROR: Could not find a version that satisfies the requirement mlc-chakra",
        "#7 ERROR: process \"/bin/bash -o pipefail -c pip install\" did not complete successfully: exit code: 1",
        "ERROR: failed to solve: process did not complete successfully: exit code: 1",
    ])
    docker = fake_docker(tmp_path, buildkit_output, 1)
    log = tmp_path / "build.log"
    result = run(["./build.sh", "--log", str(log)], env={"DOCKER": str(docker)})
    assert result.returncode == 1
    assert "✗ Docker build failed at step 2/3 (docker build, exit 1): [4/7] RUN python -c" in result.stderr
    assert f"Full output: {log}" in result.stderr
    assert "successfully!" not in result.stdout
    assert log.read_text().strip() == buildkit_output


def test_build_sh_names_the_failing_step_of_the_classic_builder(tmp_path):
    classic_output = "\n".join([
        "Step 1/12 : ARG BASE_IMAGE=pytorch/pytorch:2.4.0-cuda12.4-cudnn9-runtime",
        "Step 6/12 : RUN python scripts/download_tokenizers.py --output-dir /workspace/pretrained_models",
        " ---> Running in 0123456789ab",
        "The command '/bin/bash -o pipefail -c python scripts/download_tokenizers.py' returned a non-zero code: 137",
    ])
    docker = fake_docker(tmp_path, classic_output, 137)
    result = run(["./build.sh", "--log", str(tmp_path / "build.log")], env={"DOCKER": str(docker)})
    assert result.returncode == 137
    assert "failed at step 2/3 (docker build, exit 137): Step 6/12 : RUN python scripts/download_tokenizers.py" in result.stderr


def test_build_sh_reports_success_and_passes_its_options(tmp_path):
    docker = fake_docker(tmp_path, "#12 exporting to image\n#12 DONE 3.2s", 0)
    result = run(["./build.sh", "--tag", "mosim:test", "--no-cache", "--log", str(tmp_path / "build.log")],
                 env={"DOCKER": str(docker)})
    assert result.returncode == 0, result.stderr
    assert "✓ Docker image built successfully!" in result.stdout
    assert "mosim:test: 1234 MB" in result.stdout
    assert (tmp_path / "build_args.txt").read_text().split() == [
        "build", "--build-arg", "BASE_IMAGE=pytorch/pytorch:2.4.0-cuda12.4-cudnn9-runtime", "-t", "mosim:test",
        "--no-cache", "."]


def test_build_sh_unknown_option_is_one_line_and_exits_2():
    result = run(["./build.sh", "--fast"])
    assert result.returncode == 2
    assert result.stderr == "error: unknown option: --fast (see ./build.sh --help)\n"


# ---------------------------------------------------------------------------------------------------------
# scripts/download_tokenizers.py (the image's tokenizer step)
# ---------------------------------------------------------------------------------------------------------

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def test_tokenizer_download_offline_warns_and_lets_the_build_go_on(tmp_path):
    result = run([sys.executable, "scripts/download_tokenizers.py", "--output-dir", str(tmp_path / "pretrained"),
                  "--models", "gpt2-not-cached-anywhere"], env=OFFLINE, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "warning: could not save the gpt2-not-cached-anywhere tokenizer" in result.stderr
    # nothing half-written: neither the tokenizer folder nor a staging folder
    leftovers = list((tmp_path / "pretrained").iterdir()) if (tmp_path / "pretrained").exists() else []
    assert leftovers == []


def test_tokenizer_download_strict_fails_when_a_tokenizer_is_missing(tmp_path):
    result = run([sys.executable, "scripts/download_tokenizers.py", "--strict", "--output-dir", str(tmp_path),
                  "--models", "bert-not-cached-anywhere"], env=OFFLINE, timeout=120)
    assert result.returncode == 1


def test_tokenizer_download_saves_a_loadable_tokenizer(tmp_path):
    """From a local tokenizer folder (no network here): saved whole under output-dir/<name>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    raw.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    source = tmp_path / "src" / "gpt2"
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(source)

    out = tmp_path / "pretrained_models"
    (out / "gpt2").mkdir(parents=True)
    (out / "gpt2" / "stale.txt").write_text("from an older build")
    result = run([sys.executable, "scripts/download_tokenizers.py", "--output-dir", str(out), "--models", str(source)],
                 env=OFFLINE, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"✓ {source} tokenizer saved to {out / 'gpt2'}" in result.stdout
    assert not (out / "gpt2" / "stale.txt").exists()
    assert [p.name for p in out.iterdir()] == ["gpt2"]  # no staging folder left behind
    saved, original = AutoTokenizer.from_pretrained(out / "gpt2"), AutoTokenizer.from_pretrained(source)
    ids = saved("the lazy dog")["input_ids"]
    assert ids == original("the lazy dog")["input_ids"] and len(ids) >= 3
