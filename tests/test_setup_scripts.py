"""install_chakra_tools.sh, setup_and_convert.sh, scripts/python_env.sh and install_astra_sim.sh's options: usage,
environment reuse, GitHub unreachable, a Python without venv support, and a real conversion."""
import gzip
import hashlib
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "install_chakra_tools.sh"
SETUP = REPO / "setup_and_convert.sh"
SCRIPTS = [INSTALL, SETUP]
DATA = REPO / "tests" / "data" / "cpu"
CONVERTER = REPO / "convert_to_et.py"
needs_converter = pytest.mark.skipif(not CONVERTER.exists(), reason="convert_to_et.py (the core converter) is not in this checkout yet")


def run(cmd, *, cwd=REPO, env=None, timeout=300):
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    full_env.pop("CHAKRA_VENV", None)
    full_env.pop("CHAKRA_PYTHON", None)
    full_env.update(env or {})
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def filled_venv(tmp_path_factory):
    """A venv that sees this interpreter's packages, filled once by install_chakra_tools.sh (pip then has little
    or nothing to download). Returns the venv and the output of that first run."""
    venv = tmp_path_factory.mktemp("setup") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    first = run([INSTALL, "--venv", venv])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return venv, first


@pytest.fixture
def fake_git(tmp_path):
    """PATH with a git that behaves like one on a machine without network: fails, or hangs."""
    def make(behaviour: str) -> dict:
        bin_dir = tmp_path / f"fake-git-{behaviour}"
        bin_dir.mkdir()
        body = {"fails": 'echo "fatal: unable to access: Could not resolve host: github.com" >&2\nexit 128\n',
                "hangs": "sleep 60\n"}[behaviour]
        (bin_dir / "git").write_text("#!/bin/sh\n" + body)
        (bin_dir / "git").chmod(0o755)
        return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return make


# --- script hygiene -----------------------------------------------------------------------------------------


def test_scripts_are_shellcheck_clean():
    # The project's own shellcheck (requirements-test.txt, beside this Python), never one found elsewhere.
    shellcheck = Path(sys.executable).parent / "shellcheck"
    assert shellcheck.exists(), f"shellcheck is not in {shellcheck.parent}; ./run_tests.sh installs requirements-test.txt"
    proc = run([shellcheck, "-x", *SCRIPTS])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_usage_and_exits_0(script):
    proc = run([script, "--help"])
    assert proc.returncode == 0
    assert f"Usage: ./{script.name}" in proc.stdout
    assert "--with-official" in proc.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_unknown_option_is_one_line_pointing_at_the_help_and_exits_2(script):
    proc = run([script, "--frobnicate"])
    assert proc.returncode == 2
    assert proc.stderr == f"error: unknown option: --frobnicate (see ./{script.name} --help)\n"


def test_jobs_must_be_a_positive_number():
    proc = run([SETUP, "--jobs", "0"])
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --jobs needs a positive whole number, not '0'")


# --- setup_and_convert.sh: what it refuses before installing anything ---------------------------------------


def test_missing_folder_is_named_and_nothing_is_installed(tmp_path):
    proc = run([SETUP, "--venv", tmp_path / "venv", tmp_path / "nope"], cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: {tmp_path / 'nope'}: no such folder"
    assert not (tmp_path / "venv").exists()


def test_default_outputs_folder_missing_is_named(tmp_path):
    proc = run([SETUP, "--venv", tmp_path / "venv"], cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: outputs: no such folder"


def test_folder_without_traces_is_named(tmp_path):
    (tmp_path / "outputs" / "run").mkdir(parents=True)
    (tmp_path / "outputs" / "run" / "notes.txt").write_text("no traces here")
    proc = run([SETUP, "--venv", tmp_path / "venv", "outputs"], cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: outputs: no traces found (expected host.<rank>.json[.gz]")
    assert not (tmp_path / "venv").exists()


def test_a_file_that_is_not_a_trace_is_named_once_with_the_status_of_no_traces(tmp_path):
    """It went on to fix_host_traces.py and convert_to_et.py: two errors, exit 2 (a usage error's)."""
    (tmp_path / "notes.txt").write_text("")
    proc = run([SETUP, "--venv", tmp_path / "venv", "notes.txt"], cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: notes.txt: no traces found (expected ")
    assert not (tmp_path / "venv").exists()


def test_a_python_that_is_not_python_is_refused(tmp_path):
    """--python /bin/true passed the import check on its exit status, then "converted" nothing: Done, exit 0."""
    shutil.copytree(DATA / "gpt2_tiny_1r", tmp_path / "outputs" / "gpt2_tiny_1r")
    proc = run([SETUP, "--python", "/bin/true", "outputs"], cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr == "error: /bin/true: not a Python 3 interpreter\n"


def test_python_without_the_packages_is_refused(tmp_path):
    run_dir = tmp_path / "outputs" / "gpt2_tiny_1r"
    shutil.copytree(DATA / "gpt2_tiny_1r", run_dir)
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    proc = run([SETUP, "--python", bare / "bin" / "python", "outputs"], cwd=tmp_path)
    assert proc.returncode == 1
    assert "cannot import the conversion packages" in proc.stderr


def test_python_that_converts_but_cannot_draw_the_report_is_told_what_to_install(tmp_path):
    """--python X -- --report, X with the conversion packages and no matplotlib: the hint had been the conversion
    packages' (run ./install_chakra_tools.sh), which does not add matplotlib."""
    shutil.copytree(DATA / "gpt2_tiny_1r", tmp_path / "outputs" / "gpt2_tiny_1r")
    blocker = tmp_path / "blocker" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not installed here')\n")
    python = tmp_path / "python-without-matplotlib"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'blocker'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    proc = run([SETUP, "--python", python, "outputs", "--", "--report"], cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"error: {python} cannot draw the report (-- --report) without matplotlib: install it "
                                   f"there (pip install -r {REPO}/requirements-report.txt), drop --python to use "
                                   "chakra-venv/ (it is added there), or leave out --report")
    assert not list((tmp_path / "outputs").rglob("*.et"))


# --- install_chakra_tools.sh ------------------------------------------------------------------------------


def test_install_fills_an_environment_then_reuses_it_in_seconds(filled_venv):
    venv, first = filled_venv
    assert f"==> Installing requirements-convert.txt into {venv}" in first.stdout
    marker = venv / ".mosim-convert-requirements.sha256"
    assert marker.read_text().strip() == hashlib.sha256((REPO / "requirements-convert.txt").read_bytes()).hexdigest()
    started = time.monotonic()
    second = run([INSTALL, "--venv", venv])
    elapsed = time.monotonic() - started
    assert second.returncode == 0, second.stderr
    assert f"==> Reusing {venv} (requirements already installed)" in second.stdout
    assert "Installing" not in second.stdout
    assert elapsed < 15


def test_changed_requirements_are_installed_again(filled_venv):
    venv, _ = filled_venv
    marker = venv / ".mosim-convert-requirements.sha256"
    wanted = marker.read_text()
    marker.write_text("hash of an older requirements file\n")
    proc = run([INSTALL, "--venv", venv])
    assert proc.returncode == 0, proc.stderr
    assert "==> Installing requirements-convert.txt" in proc.stdout
    assert marker.read_text() == wanted


def test_folder_that_is_not_a_venv_is_refused(tmp_path):
    target = tmp_path / "chakra-venv"
    target.mkdir()
    (target / "something").write_text("x")
    proc = run([INSTALL, "--venv", target])
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: {target} exists but is not a Python virtual environment (no bin/python); remove it or pass --venv"


@pytest.mark.parametrize("behaviour", ["fails", "hangs"])
def test_with_official_says_plainly_when_github_cannot_be_reached(filled_venv, fake_git, behaviour):
    venv, _ = filled_venv
    env = fake_git(behaviour)
    env["CHAKRA_NET_TIMEOUT"] = "2"
    started = time.monotonic()
    proc = run([INSTALL, "--venv", venv, "--with-official"], env=env, timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "warning: official et_replay not installed: cannot reach github.com" in proc.stderr
    assert "==> Conversion environment ready" in proc.stdout  # what the converter needs is there all the same
    assert elapsed < 30  # 2 s for GitHub plus the reuse check, not a hang


def venv_megabytes(venv: Path) -> float:
    return sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


@pytest.mark.slow
def test_fresh_venv_is_created_without_system_packages_and_imports_chakra(tmp_path):
    venv = tmp_path / "chakra-venv"
    started = time.monotonic()
    proc = run([INSTALL, "--venv", venv], timeout=600)
    created_in = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"==> Creating {venv}" in proc.stdout
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import chakra.schema.protobuf.et_def_pb2 as m, orjson; print(m.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(venv))
    # mlc-chakra without HolisticTraceAnalysis (jupyterlab, pandas, plotly): a laptop-sized environment.
    assert not list(venv.glob("lib/python*/site-packages/hta")), "HolisticTraceAnalysis was installed"
    assert not list(venv.glob("lib/python*/site-packages/pandas")), "pandas was installed"
    assert venv_megabytes(venv) < 100, f"{venv}: {venv_megabytes(venv):.0f} MB"
    assert len(proc.stdout.splitlines()) <= 5, proc.stdout  # one line per step, not pip's hundreds
    started = time.monotonic()
    again = run([INSTALL, "--venv", venv])
    assert again.returncode == 0 and "==> Reusing" in again.stdout
    assert time.monotonic() - started < 15
    print(f"fresh chakra-venv created in {created_in:.0f} s, {venv_megabytes(venv):.0f} MB")
    # The laptop install of pyproject.toml's conversion side: the project's wheel in this torch-free environment
    # gives mosim-convert, which converts a run from any folder.
    wheel = build_wheel(tmp_path / "wheel")
    installed = run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", wheel])
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert run([venv / "bin" / "python", "-c", "import torch"]).returncode == 1
    run_dir = tmp_path / "laptop" / "gpt2_tiny_1r"
    shutil.copytree(DATA / "gpt2_tiny_1r", run_dir)
    converted = run([venv / "bin" / "mosim-convert", run_dir], cwd=tmp_path)
    assert converted.returncode == 0, converted.stdout[-2000:] + converted.stderr[-2000:]
    assert (run_dir / "gpt2_tiny_1r.0.et").stat().st_size > 0


def build_wheel(out: Path) -> Path:
    """The project's wheel, built from a copy of what pyproject.toml packages (a build writes build/ and
    *.egg-info beside its sources), with this interpreter's setuptools."""
    import tomllib

    source = out / "source"
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for name in ["pyproject.toml", "README.md", *(f.name for f in REPO.glob("requirements*.txt")),
                 *(f"{m}.py" for m in settings["py-modules"])]:
        source.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    for package in settings["packages"]:
        shutil.copytree(REPO / package.replace(".", "/"), source / package.replace(".", "/"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    built = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, source])
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = out.glob("mosim_llms-*.whl")
    return wheel


def test_with_report_adds_matplotlib_to_the_environment(filled_venv):
    venv, _ = filled_venv
    proc = run([INSTALL, "--venv", venv, "--with-report"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert subprocess.run([str(venv / "bin" / "python"), "-c", "import matplotlib"]).returncode == 0


# --- entry points run by a Python without the packages --------------------------------------------------------


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A Python with nothing installed: a venv that does not see this interpreter's packages."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


@pytest.mark.parametrize("entry, remedy", [
    ("convert_to_et.py", "./setup_and_convert.sh"),
    ("convert_remaining.py", "./setup_and_convert.sh"),
    ("fix_host_traces.py", "./setup_and_convert.sh"),
    ("trace_report.py", "./install_chakra_tools.sh --with-report"),
    ("simulate.py", "./setup_and_convert.sh"),  # had been a ModuleNotFoundError traceback
    ("scale_et.py", "./setup_and_convert.sh"),
    ("gpt2/train.py", "source .venv/bin/activate"),
    ("bert/train.py", "source .venv/bin/activate"),
])
def test_entry_point_without_its_packages_names_the_environment_in_one_line(bare_python, entry, remedy):
    proc = run([bare_python, REPO / entry, "--help"])
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"error: {bare_python} has no ") and remedy in line, line
    assert "source .venv/bin/activate" in line
    if not entry.endswith("train.py"):  # pip install '.[convert]' users have neither chakra-venv/ nor .venv/
        assert "pip install '.[report]'" in line if entry == "trace_report.py" else "pip install '.[convert]'" in line


def test_mosim_train_without_torch_names_the_environment_in_one_line(bare_python):
    """pip install .[convert] installs mosim-train too; `mosim-train gpt2 --help` there was a torch traceback."""
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from utils.families import train_main; " \
           "sys.exit(train_main(['gpt2', '--help']))"
    proc = run([bare_python, "-c", code])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"error: {bare_python} has no torch") and "pip install '.[train]'" in line


def test_the_environment_named_from_another_folder_is_named_by_its_full_path(bare_python, tmp_path):
    """cd /tmp && python3 /repo/convert_to_et.py DIR had named ./setup_and_convert.sh and .venv/, which are not there."""
    proc = subprocess.run([str(bare_python), str(REPO / "convert_to_et.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert f"{REPO}/setup_and_convert.sh (creates {REPO}/chakra-venv/), or source {REPO}/.venv/bin/activate" in line


def test_setup_and_convert_reuses_an_active_environment_that_has_the_packages(tmp_path):
    if (REPO / "chakra-venv").exists():
        pytest.skip("this checkout has a chakra-venv/, which setup_and_convert.sh reuses first")
    shutil.copytree(DATA / "gpt2_tiny_1r", tmp_path / "outputs" / "gpt2_tiny_1r")
    active = Path(sys.executable).parent.parent  # the environment running the tests has the conversion packages
    proc = run([SETUP, "outputs"], cwd=tmp_path, env={"VIRTUAL_ENV": str(active)}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"==> Using {active} (it has the conversion packages; no chakra-venv/ needed)" in proc.stdout
    assert not (REPO / "chakra-venv").exists()
    assert list((tmp_path / "outputs" / "gpt2_tiny_1r").glob("*.0.et"))


# --- setup_and_convert.sh end to end ----------------------------------------------------------------------


def read_et(path: Path):
    """Decode a Chakra .et: GlobalMetadata then nodes, with mlc-chakra's own reader."""
    from chakra.schema.protobuf.et_def_pb2 import GlobalMetadata, Node
    from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd

    handle = openFileRd(str(path))
    try:
        metadata = GlobalMetadata()
        assert decodeMessage(handle, metadata)
        nodes = []
        while True:
            node = Node()
            if not decodeMessage(handle, node):
                break
            nodes.append(node)
    finally:
        handle.close()
    return metadata, nodes


def assert_runnable_et(path: Path):
    """Every dependency names a node, and issuing nodes whose dependencies are done reaches them all."""
    _, nodes = read_et(path)
    assert nodes, f"{path} holds no nodes"
    ids = {node.id for node in nodes}
    waiting = {}
    pending = {}
    for node in nodes:
        deps = set(node.data_deps) | set(node.ctrl_deps)
        assert deps <= ids, f"{path}: node {node.id} depends on missing nodes {sorted(deps - ids)[:5]}"
        pending[node.id] = len(deps)
        for dep in deps:
            waiting.setdefault(dep, []).append(node.id)
    ready = [node_id for node_id, count in pending.items() if count == 0]
    done = 0
    while ready:
        node_id = ready.pop()
        done += 1
        for child in waiting.get(node_id, ()):
            pending[child] -= 1
            if pending[child] == 0:
                ready.append(child)
    assert done == len(nodes), f"{path}: only {done} of {len(nodes)} nodes can run (a cycle)"
    return nodes


@needs_converter
@pytest.mark.parametrize("case", ["a rank fails", "a bad flag"])
def test_setup_and_convert_names_the_retry_only_for_failed_ranks_and_quotes_it(tmp_path, case):
    """A bad flag for convert_to_et.py was followed by "failed ranks are listed above ... retry them with", though no
    rank had failed, and the retry command broke a folder with a space in its name into two."""
    run_dir = tmp_path / "my outputs" / "gpt2_tiny_2r"
    shutil.copytree(DATA / "gpt2_tiny_2r", run_dir)
    extra = ["--", "--jobs", "many"] if case == "a bad flag" else []
    if case == "a rank fails":
        (run_dir / "device.1.json.gz").write_bytes(b"not a trace")
    proc = run([SETUP, "--python", sys.executable, str(run_dir), *extra], cwd=tmp_path, timeout=600)
    retry = [line for line in proc.stderr.splitlines() if "retry them with" in line]
    if case == "a bad flag":
        assert proc.returncode == 2 and not retry, proc.stderr
        # refused by convert_to_et.py's parser before any host trace was checked or rewritten
        assert proc.stderr.splitlines()[-1] == ("error: convert_to_et.py: argument --jobs: invalid int value: 'many' "
                                                "(see convert_to_et.py --help)")
        assert "Checking host traces" not in proc.stdout
    else:
        assert proc.returncode == 1 and len(retry) == 1, proc.stderr
        command = retry[0].split("retry them with: ", 1)[1]
        assert shlex.split(command) == [sys.executable, str(REPO / "convert_remaining.py"), str(run_dir)]


@needs_converter
def test_the_retry_of_a_failed_rank_keeps_the_conversion_options_and_converts_into_the_same_folder(tmp_path):
    """The retry dropped the options after --: followed, it converted rank 1 into the run folder and left the
    --output-dir folder with rank 0 alone."""
    run_dir, out = tmp_path / "sc" / "run1", tmp_path / "converted out"
    shutil.copytree(DATA / "gpt2_tiny_2r", run_dir)
    device_1 = run_dir / "device.1.json.gz"
    kept = device_1.read_bytes()
    device_1.unlink()
    proc = run([SETUP, "--python", sys.executable, "--jobs", "1", run_dir, "--", "--output-dir", out, "--no-progress"],
               cwd=tmp_path, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    [retry] = [line.split("retry them with: ", 1)[1] for line in proc.stderr.splitlines() if "retry them with" in line]
    assert shlex.split(retry) == [sys.executable, str(REPO / "convert_remaining.py"), "--jobs", "1", str(run_dir),
                                  "--output-dir", str(out), "--no-progress"]
    device_1.write_bytes(kept)  # the rank's trace copied again, then the retry as printed
    again = subprocess.run(["bash", "-c", retry], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert sorted(p.name for p in out.glob("*.et")) == ["run1.0.et", "run1.1.et"]
    assert not list(run_dir.glob("*.et"))


@needs_converter
def test_setup_and_convert_ends_naming_the_python_for_the_commands_that_follow(tmp_path):
    """After the main job it used .venv and said so, and the README's next command, chakra-venv/bin/python
    scale_et.py, did not exist (exit 127): its last line now names the interpreter."""
    shutil.copytree(DATA / "gpt2_tiny_1r", tmp_path / "outputs" / "gpt2_tiny_1r")
    venv = tmp_path / "env"  # a venv of its own (with an activate script) that sees this interpreter's packages
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    [purelib] = venv.glob("lib/python*/site-packages")
    (purelib / "running_environment.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    proc = run([SETUP, "--python", venv / "bin" / "python", "outputs", "--", "--no-progress"], cwd=tmp_path,
               timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.splitlines()[-1]
    assert last == ("==> Python for scale_et.py, simulate.py and trace_report.py: env/bin/python "
                    "(or python3 after: source env/bin/activate)")
    follow = subprocess.run(["bash", "-c", "source env/bin/activate && python3 -c 'import sys; print(sys.prefix)'"],
                            cwd=tmp_path, capture_output=True, text=True, check=True)
    assert follow.stdout.strip() == str(venv)


@needs_converter
def test_setup_and_convert_repairs_and_converts_a_two_rank_cpu_run(tmp_path):
    run_dir = tmp_path / "outputs" / "bert_tiny_2r"
    shutil.copytree(DATA / "bert_tiny_2r", run_dir)
    # Rank 1's observer wrote twice: the repair step must fix it before the converter sees it.
    host1 = run_dir / "host.1.json.gz"
    text = gzip.decompress(host1.read_bytes())
    host1.write_bytes(gzip.compress(text + text))
    proc = run([SETUP, "--python", sys.executable, "--jobs", "1"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"==> Using {sys.executable} (it has the conversion packages; no chakra-venv/ needed)" in proc.stdout
    assert "repaired: outputs/bert_tiny_2r/host.1.json.gz: 2 JSON objects concatenated" in proc.stdout
    assert (run_dir / "host.1.json.gz.orig").is_file()
    et_files = sorted(tmp_path.rglob("*.et"))
    assert [p.name.rsplit(".", 2)[1] for p in et_files] == ["0", "1"], et_files
    for path in et_files:
        assert_runnable_et(path)
    assert list(tmp_path.rglob("CONVERSION_SUMMARY.md"))


@needs_converter
def test_setup_and_convert_passes_a_failed_rank_through_as_non_zero(tmp_path):
    run_dir = tmp_path / "outputs" / "bert_tiny_2r"
    shutil.copytree(DATA / "bert_tiny_2r", run_dir)
    (run_dir / "host.1.json.gz").write_bytes(gzip.compress(b""))  # rank 1 cannot be repaired
    proc = run([SETUP, "--python", sys.executable, "outputs"], cwd=tmp_path, timeout=600)
    assert proc.returncode != 0
    assert "error: outputs/bert_tiny_2r/host.1.json.gz: empty file" in proc.stderr
    et_files = sorted(p.name for p in tmp_path.rglob("*.et"))
    assert len(et_files) == 1 and et_files[0].endswith(".0.et")  # the good rank is still converted


# --- bad values, a Python without venv support, install_astra_sim.sh's --source ------------------------------------


@pytest.mark.parametrize("script, args, says", [
    (SETUP, ["--venv", "--with-official"], "error: --venv needs a value (got --with-official)"),
    (SETUP, ["--venv="], "error: --venv needs a value"),
    (SETUP, ["--python", "--jobs", "2"], "error: --python needs a value (got --jobs)"),
    (INSTALL, ["--venv", "--with-report"], "error: --venv needs a folder (got --with-report)"),
    (INSTALL, ["--venv="], "error: --venv needs a folder"),
])
def test_an_option_missing_its_value_does_not_swallow_the_next_option(tmp_path, script, args, says):
    """`--venv --with-official` once made a virtual environment named ./--with-official."""
    proc = run([script, *args], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == f"{says} (see ./{script.name} --help)\n"
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def python_without_venv(tmp_path) -> dict:
    """PATH with Debian's python3 without python3-venv: `-m venv` makes the environment without pip, then fails."""
    bin_dir = tmp_path / "no-venv-bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = venv ]; then
    {sys.executable} -m venv --without-pip "$3"
    echo "The virtual environment was not created successfully because ensurepip is not"
    echo "available.  On Debian/Ubuntu systems, you need to install the python3-venv"
    exit 1
fi
exec {sys.executable} "$@"
""")
    (bin_dir / "python3").chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_install_without_venv_support_says_so_in_one_line_and_leaves_no_half_made_venv(tmp_path, python_without_venv):
    venv = tmp_path / "chakra-venv"
    for _ in range(2):  # the second run meets the same clean state, not a venv without pip
        proc = run([INSTALL, "--venv", venv], env=python_without_venv)
        assert proc.returncode == 1
        [line] = proc.stderr.splitlines()
        assert line.startswith(f"error: '{tmp_path}/no-venv-bin/python3 -m venv {venv}' failed (The virtual "
                               "environment was not created successfully because ensurepip is not)"), line
        assert line.endswith("sudo apt-get install python3-venv")
        assert not venv.exists()


def test_python_env_without_venv_support_says_so_and_leaves_no_half_made_venv(tmp_path, python_without_venv):
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "python_env.sh", root / "scripts")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHON", "VIRTUAL_ENV")}
    proc = subprocess.run(["bash", str(root / "scripts" / "python_env.sh"), "train"], env={**env, **python_without_venv},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1].startswith(f"error: '{tmp_path}/no-venv-bin/python3 -m venv {root}/.venv' "
                                                   "failed (The virtual environment was not created successfully")
    assert not (root / ".venv").exists()


def fake_python(path: Path, project: Path, pip_log: Path) -> Path:
    """This interpreter importing the project from `project`, whose pip only logs what it was asked to install (a
    regression must not install anything into the environment running these tests)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nif [ \"$1 $2\" = \"-m pip\" ]; then echo \"$*\" >> {shlex.quote(str(pip_log))}; exit 0; fi\n"
                    f"PYTHONPATH={shlex.quote(str(project))} exec {shlex.quote(sys.executable)} \"$@\"\n")
    path.chmod(0o755)
    return path


def test_an_environment_of_another_checkout_is_left_to_it(tmp_path):
    """A second clone's launcher, run with the first clone's .venv active, installed itself into that .venv: the
    first clone's commands then ran the second's code."""
    root, other = tmp_path / "checkout", tmp_path / "other"
    for checkout in (root, other):
        (checkout / "scripts").mkdir(parents=True)
        shutil.copy(REPO / "scripts" / "python_env.sh", checkout / "scripts")
        (checkout / "trace_tools").mkdir()
        (checkout / "trace_tools" / "__init__.py").write_text("")
    (root / "utils").mkdir()
    shutil.copy(REPO / "utils" / "environment.py", root / "utils")
    for requirements in REPO.glob("requirements*.txt"):
        shutil.copy(requirements, root)
    pip_log = tmp_path / "pip.log"
    others = fake_python(tmp_path / "other-venv" / "bin" / "python", other, pip_log)
    own = fake_python(root / ".venv" / "bin" / "python", root, pip_log)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHON", "VIRTUAL_ENV")}
    proc = subprocess.run(["bash", str(root / "scripts" / "python_env.sh"), "train"], env={**env, "PYTHON": str(others)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{own}\n"
    assert f"==> {others} runs this project from {other}; leaving it to that checkout, this one uses {root}/.venv" \
        in proc.stderr.replace("\n", " ")
    assert not pip_log.exists()


ASTRA = REPO / "install_astra_sim.sh"


@pytest.fixture
def astra_tree(tmp_path) -> Path:
    """An ASTRA-sim tree as install_astra_sim.sh checks one (the files it looks for), under prefix/src."""
    tree = tmp_path / "prefix" / "src"
    for path in ("build/astra_analytical/CMakeLists.txt", "extern/graph_frontend/chakra/schema/protobuf/et_def.proto",
                 "extern/graph_frontend/chakra/src/feeder_v3/et_feeder.h",
                 "extern/network_backend/analytical/include/astra-network-analytical/a.h",
                 "extern/network_backend/analytical/CMakeLists.txt", "extern/remote_memory_backend/analytical/a",
                 "extern/helper/fmt/a", "extern/helper/spdlog/a", "astra-sim/a.cc"):
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text("")
    return tree


@pytest.fixture
def no_build_tools(tmp_path) -> dict:
    """PATH whose cmake and protoc fail at once: nothing is ever built by these tests."""
    bin_dir = tmp_path / "no-build-bin"
    bin_dir.mkdir()
    for tool in ("cmake", "protoc"):
        (bin_dir / tool).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.parametrize("prefix, says", [
    ("prefix", "error: --source {tree} is inside {tmp}/prefix/src, which a build deletes before copying the tree "
               "there; copy the tree elsewhere or pass another --prefix"),
    ("prefix/src/install", "error: --prefix {tmp}/prefix/src/install is inside --source {tree} (the tree would be "
                           "copied into itself); pass a --prefix outside it"),
])
def test_astra_source_in_the_prefix_is_refused_and_kept(tmp_path, astra_tree, no_build_tools, prefix, says):
    """`--source PREFIX/src` (rebuilding a patched tree in place) once deleted the tree before copying it."""
    proc = run([ASTRA, "--source", astra_tree, "--prefix", tmp_path / prefix], env=no_build_tools)
    assert proc.returncode == 2
    assert proc.stderr == says.format(tree=astra_tree, tmp=tmp_path) + " (see ./install_astra_sim.sh --help)\n"
    assert (astra_tree / "astra-sim" / "a.cc").exists() and not (astra_tree / "install").exists()


@pytest.mark.parametrize("args, says", [
    (["--source="], "error: --source needs a value"),
    (["--prefix", "--dry-run"], "error: --prefix needs a value (got the option --dry-run)"),
    (["--yaml-cpp", ""], "error: --yaml-cpp needs a value"),
])
def test_astra_empty_or_missing_values_are_usage_errors_not_a_clone(tmp_path, args, says):
    """An empty --source once meant "no --source": it cloned from GitHub."""
    proc = run([ASTRA, *args, "--dry-run"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == f"{says} (see ./install_astra_sim.sh --help)\n" and "Cloning" not in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_astra_source_tree_edited_since_its_build_is_built_again_not_reused(tmp_path, astra_tree, no_build_tools):
    """The install was recognised by the --source path alone (or its git HEAD): a tree patched since, or one outside
    git, was reported as "Reusing" the binary built from its earlier files."""
    prefix = tmp_path / "install"
    dry = run([ASTRA, "--source", astra_tree, "--prefix", prefix, "--dry-run"], env=no_build_tools)
    # a dry run says it built nothing (it had ended "ASTRA-sim ready" with an export line for no binary)
    assert "ASTRA-sim ready" not in dry.stdout and "export ASTRA_SIM=" not in dry.stdout
    assert dry.stdout.splitlines()[-1].startswith("==> Dry run done: nothing was built")
    [described] = re.findall(r"would build (.+)\)$", dry.stdout.splitlines()[0])
    assert described.startswith(f"{astra_tree} (files checksum ")
    (prefix / "bin").mkdir(parents=True)  # as a build from these files leaves it
    (prefix / "bin" / "AstraSim_Analytical_Congestion_Unaware").write_text("#!/bin/sh\n")
    (prefix / "bin" / "AstraSim_Analytical_Congestion_Unaware").chmod(0o755)
    (prefix / ".mosim-astra-sim-source").write_text(described + "\n")
    again = run([ASTRA, "--source", astra_tree, "--prefix", prefix], env=no_build_tools)
    assert again.returncode == 0 and again.stdout.startswith(f"==> Reusing {prefix}/bin/")
    (astra_tree / "astra-sim" / "a.cc").write_text("// patched\n")
    patched = run([ASTRA, "--source", astra_tree, "--prefix", prefix, "--dry-run"], env=no_build_tools)
    assert patched.returncode == 0 and "Reusing" not in patched.stdout
    assert patched.stdout.splitlines()[0] != dry.stdout.splitlines()[0]


def test_a_yaml_cpp_tree_edited_since_the_build_is_built_again_not_reused(tmp_path, astra_tree, no_build_tools):
    """yaml-cpp is compiled into the simulator: a --yaml-cpp tree patched since the build was "reused" (the
    description held only the --source tree's checksum)."""
    yaml_cpp = tmp_path / "yaml-cpp"
    (yaml_cpp / "src").mkdir(parents=True)
    (yaml_cpp / "CMakeLists.txt").write_text("project(YAML_CPP)\n")
    prefix = tmp_path / "install"
    command = [ASTRA, "--source", astra_tree, "--yaml-cpp", yaml_cpp, "--prefix", prefix]
    [described] = re.findall(r"would build (.+)\)$", run([*command, "--dry-run"], env=no_build_tools).stdout.splitlines()[0])
    assert f"with yaml-cpp {yaml_cpp} (files checksum " in described
    (prefix / "bin").mkdir(parents=True)  # as a build from these files leaves it
    (prefix / "bin" / "AstraSim_Analytical_Congestion_Unaware").write_text("#!/bin/sh\n")
    (prefix / "bin" / "AstraSim_Analytical_Congestion_Unaware").chmod(0o755)
    (prefix / ".mosim-astra-sim-source").write_text(described + "\n")
    assert run(command, env=no_build_tools).stdout.startswith(f"==> Reusing {prefix}/bin/")
    (yaml_cpp / "src" / "parse.cpp").write_text("// patched\n")
    patched = run([*command, "--dry-run"], env=no_build_tools)
    assert patched.returncode == 0 and "Reusing" not in patched.stdout and "would build" in patched.stdout
