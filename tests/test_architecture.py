"""The code's shape: one definition of the trace layout, no import cycle in trace_tools, no function over 100 lines."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYOUT = REPO / "trace_tools" / "layout.py"
# Every non-test Python source of the repository (not tests/, environments, outputs or hidden folders).
NOT_SOURCES = {"tests", "outputs", "checkpoints", "logs", "converted", "data", "build"}
SOURCES = sorted(p for p in REPO.rglob("*.py") if not any(
    part in NOT_SOURCES or part.startswith(".") or "venv" in part for part in p.relative_to(REPO).parts[:-1]))

# ---- one trace layout ------------------------------------------------------------------------------------------
# The rule: outside trace_tools/layout.py, no string in code (docstrings are prose and exempt; comments are not
# strings) holds the layout's mechanics: the step annotation's prefix, the process-group node's name, the run
# metadata key, or a per-rank file pattern (host.{rank}..., {name}.{rank}.et); and no string IS one of its file
# names (a string that equals "run.json" is that file used as a name: a path, a definition, a comparison). Messages
# may mention a file in prose ("see CONVERSION_SUMMARY.md"); a name they build a path from comes from the layout.
LAYOUT_MECHANICS = re.compile(r"ProfilerStep#|## process_group:init ##|mosim_run|(?<!\w)(host|device|stacks|\{kind\})\.\{"
                              r"|\}\.et\b")
LAYOUT_FILE_NAMES = {"CONVERSION_SUMMARY.md", "run.json"}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _code_strings(tree: ast.AST):
    """(line, text) of every string in code: constants, and f-strings as written (`f'{name}.{rank}.et'`)."""
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip.update(id(part) for part in ast.walk(node) if part is not node)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):
            yield node.lineno, ast.unparse(node)


def test_the_trace_layout_is_defined_only_in_trace_tools_layout():
    found = []
    for path in SOURCES:
        if path == LAYOUT:
            continue
        for line, text in _code_strings(ast.parse(path.read_text(encoding="utf-8"))):
            if LAYOUT_MECHANICS.search(text) or text in LAYOUT_FILE_NAMES:
                found.append(f"{path.relative_to(REPO)}:{line}: {text[:80]!r}")
    assert not found, "define or build these from trace_tools/layout.py:\n" + "\n".join(found)


def test_the_layout_check_finds_a_copied_definition():
    copied = ast.parse('HOST = "host.{rank}.json"\nout = folder / f"{name}.{rank}.et"\nx = "run.json"\n'
                       'def f():\n    """host.{rank}.json in a docstring is prose"""\n')
    hits = sorted(line for line, text in _code_strings(copied) if LAYOUT_MECHANICS.search(text) or text in LAYOUT_FILE_NAMES)
    assert hits == [1, 2, 3]


# ---- no import cycle in trace_tools ----------------------------------------------------------------------------
def trace_tools_imports() -> dict[str, set[str]]:
    """Module -> the trace_tools modules it imports anywhere in its code (a lazy import inside a function counts:
    it only hides a cycle)."""
    modules = {p.stem: p for p in (REPO / "trace_tools").glob("*.py") if p.stem != "__init__"}
    imports: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level == 1 or module.startswith("trace_tools"):
                    base = module.removeprefix("trace_tools").lstrip(".")
                    found.update([base] if base else [alias.name for alias in node.names])
            elif isinstance(node, ast.Import):
                found.update(a.name.removeprefix("trace_tools.") for a in node.names if a.name.startswith("trace_tools."))
        imports[name] = {m.split(".")[0] for m in found} & modules.keys()
    return imports


def test_trace_tools_modules_import_each_other_without_a_cycle():
    from trace_tools.graph import topological_order

    imports = trace_tools_imports()
    names = sorted(imports)
    order = topological_order([[names.index(m) for m in imports[name]] for name in names])
    on_cycle = sorted(set(names) - {names[i] for i in order})
    assert not on_cycle, "import cycle among: " + ", ".join(f"{n} -> {sorted(imports[n])}" for n in on_cycle)
    assert "pipeline" in imports["summary"] or "summary" in imports["pipeline"]  # the check sees lazy imports too


@pytest.mark.parametrize("module", sorted(p.stem for p in (REPO / "trace_tools").glob("*.py")))
def test_each_trace_tools_module_imports_alone_in_a_fresh_interpreter(module):
    done = subprocess.run([sys.executable, "-c", f"import trace_tools.{module}"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# ---- short functions -------------------------------------------------------------------------------------------
MAX_FUNCTION_LINES = 100


def test_no_function_in_trace_tools_or_utils_is_over_100_lines():
    long = []
    for path in sorted([*(REPO / "trace_tools").glob("*.py"), *(REPO / "utils").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # decorators aside, docstring and body included
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert not long, "split these into named steps:\n" + "\n".join(long)


# ---- an installed package, not sys.path edits ------------------------------------------------------------------
# utils/launch/ is the one exception: ./run_*.sh start it with any python3, before the environment that holds the
# installed project exists (the launcher finds or makes that environment).
SYS_PATH_EDIT = re.compile(r"sys\.path(\.insert|\.append|\[|\s*=|\s*\+=)")
BOOTSTRAP = {REPO / "utils" / "launch" / "__main__.py"}


def test_no_source_edits_sys_path_but_the_launcher_bootstrap():
    edits = [f"{path.relative_to(REPO)}:{number}" for path in SOURCES if path not in BOOTSTRAP
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if SYS_PATH_EDIT.search(line)]
    assert not edits, "import from the installed project (pyproject.toml) instead: " + ", ".join(edits)
    assert any(SYS_PATH_EDIT.search(line) for path in BOOTSTRAP for line in path.read_text().splitlines())


def console_scripts() -> dict[str, str]:
    import tomllib  # Python 3.11+, the tests' interpreter

    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]


needs_tomllib = pytest.mark.skipif(sys.version_info < (3, 11), reason="reads pyproject.toml with tomllib (3.11+)")


@needs_tomllib
def test_every_console_script_names_a_function_of_a_packaged_module():
    import tomllib

    settings = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    packaged = set(settings["packages"]) | set(settings["py-modules"])
    probe = "import importlib, sys\nfor target in sys.argv[1:]:\n    module, name = target.split(':')\n" \
            "    assert callable(getattr(importlib.import_module(module), name)), target\n"
    targets = sorted(console_scripts().values())
    modules = {target.split(":")[0] for target in targets}
    assert all(module in packaged or module.rsplit(".", 1)[0] in packaged for module in modules), modules
    # From another folder: the installed project, not the current directory, provides them.
    done = subprocess.run([sys.executable, "-c", probe, *targets], cwd="/", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@needs_tomllib
@pytest.mark.parametrize("command", ["mosim-convert", "mosim-fix-traces", "mosim-report",
                                     "mosim-simulate", "mosim-scale"])
def test_the_installed_conversion_commands_answer_help_from_any_folder(command, tmp_path):
    assert command in console_scripts()
    done = subprocess.run([str(Path(sys.executable).parent / command), "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]


@pytest.mark.parametrize("script, args, says", [
    ("convert_to_et.py", ["--jobs", "many"], "argument --jobs: invalid int value: 'many'"),
    ("convert_remaining.py", ["--bogus"], "unrecognized arguments: --bogus"),
    ("fix_host_traces.py", ["--min-nodes"], "argument --min-nodes: expected one argument"),
    ("trace_report.py", [], "the following arguments are required: DIR"),
    ("simulate.py", ["run"], "the following arguments are required: --bandwidth"),
    ("scale_et.py", ["run", "--ranks", "8", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_every_conversion_command_refuses_a_bad_flag_in_one_line_naming_itself(script, args, says, tmp_path):
    done = subprocess.run([sys.executable, str(REPO / script), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and not done.stdout
    assert done.stderr == f"error: {script}: {says} (see {script} --help)\n"


# Scripts that the Docker image runs before the project is in it (COPY of the one file): plain argparse. The
# trainers refuse their flags through utils/run_config.RunArgumentParser, in the same one-line form.
PLAIN_ARGPARSE = {REPO / "scripts" / "pip_constraints.py", REPO / "scripts" / "download_tokenizers.py"}


def test_every_other_command_line_builds_the_one_line_parser():
    plain = [f"{path.relative_to(REPO)}:{number}" for path in SOURCES if path not in PLAIN_ARGPARSE
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if "argparse.ArgumentParser(" in line]
    assert not plain, "use trace_tools.command_line.ArgumentParser: " + ", ".join(plain)


def test_mosim_train_runs_a_registered_family_and_names_the_known_ones(tmp_path):
    train = str(Path(sys.executable).parent / "mosim-train")
    usage = subprocess.run([train], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: mosim-train {gpt2,bert")
    unknown = subprocess.run([train, "llama"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2
    assert unknown.stderr.strip() == "error: unknown model family 'llama'"
    helped = subprocess.run([train, "bert", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: bert/train.py"), helped.stderr[-2000:]


def test_a_train_script_run_by_a_python_without_the_project_says_so_in_one_line():
    # -S: no site-packages, so neither the installed project nor torch; the project is what it names first.
    done = subprocess.run([sys.executable, "-S", str(REPO / "gpt2" / "train.py"), "--help"], cwd="/",
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: {sys.executable} has no mosim-llms") and "pip install -e ." in line


# ---- what each side needs is declared ----------------------------------------------------------------------------
def _unconditional_third_party_imports(path: Path, project: set[str]) -> set[str]:
    """Top-level packages a module imports at its top level, outside try blocks (an optional import sits in one)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {name for name in names if name not in sys.stdlib_module_names and name not in project}


def test_every_package_the_training_side_imports_is_required_and_checked():
    # The trainers' own modules as a run loads them; each of their unconditional third-party imports must be in
    # requirements.txt and in what require("training") checks, or a training-only install fails with a traceback.
    # (The tracer's orjson was missing from both: gpt2/train.py failed to import where only requirements.txt went in.)
    loaded = subprocess.run([sys.executable, "-c", "import sys, gpt2.train, bert.train\n"
                             "print('\\n'.join(m.__file__ for m in list(sys.modules.values())"
                             " if (getattr(m, '__file__', None) or '').startswith(sys.argv[1])))", str(REPO)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    own = [Path(line) for line in loaded.stdout.splitlines() if not {"tests", ".venv"} & set(Path(line).parts)]
    assert REPO / "utils" / "chakra_tracer.py" in own
    project = {p.name for p in REPO.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    imported = set().union(*(_unconditional_third_party_imports(path, project) for path in own))
    from utils.environment import MODULES
    checked = {name.split(".")[0] for name in MODULES["training"]}
    required = {re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0].lower()
                for line in (REPO / "requirements.txt").read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.lstrip().startswith("#")}
    assert "torch" in imported and imported <= checked, sorted(imported - checked)
    assert checked <= required, sorted(checked - required)
