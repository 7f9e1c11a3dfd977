"""Which Python environment each entry point needs, checked before the heavy imports (standard library only, no torch).

An entry point calls ``require("training")`` (or "conversion", "report") before importing its packages: with a
Python that lacks one, the user reads one line naming the environment to use instead of a ModuleNotFoundError.
``python utils/environment.py check-requirements FILE...`` is what scripts/python_env.sh asks before it reuses
an environment (every requirement of the files installed, at a version the file accepts), and
``python utils/environment.py has conversion`` what install_chakra_tools.sh and setup_and_convert.sh ask.
"""
import importlib
import importlib.util
import sys
from importlib import metadata
from pathlib import Path
from typing import List, Sequence

# What each side imports; the requirements files say which distributions provide them.
MODULES = {
    "training": ("torch", "transformers", "datasets", "tokenizers", "safetensors", "numpy", "tqdm", "orjson"),
    "conversion": ("orjson", "tqdm", "google.protobuf", "chakra.schema.protobuf.et_def_pb2",
                   "chakra.src.third_party.utils.protolib"),
    "report": ("orjson", "tqdm", "google.protobuf", "chakra.schema.protobuf.et_def_pb2",
               "chakra.src.third_party.utils.protolib", "matplotlib"),
}
# How to get an environment that has them, in the words the README uses.
# Where the repository's scripts ({run}: "./") and environments ({repo}: "") are, named from its folder; from
# elsewhere both are its full path (remedy).
REMEDY = {
    "training": "source {repo}.venv/bin/activate ({run}run_tests.sh or {run}run_all_profiling.sh creates "
                "{repo}.venv), or install the [train] extra (pip install '.[train]')",
    "conversion": "{run}setup_and_convert.sh (creates {repo}chakra-venv/), or source {repo}.venv/bin/activate, or "
                  "install the [convert] extra (pip install '.[convert]')",
    "report": "{run}install_chakra_tools.sh --with-report, then source {repo}chakra-venv/bin/activate; "
              "or source {repo}.venv/bin/activate; or install the [report] extra (pip install '.[report]')",
}


def missing_modules(modules: Sequence[str], import_them: bool = False) -> List[str]:
    """The modules that cannot be found (a parent package missing counts as the module missing); with
    import_them, also those that are there but fail to import (e.g. generated protobuf code too new for the runtime)."""
    missing = []
    for name in modules:
        try:
            found = importlib.import_module(name) is not None if import_them else importlib.util.find_spec(name) is not None
        except Exception:  # noqa: BLE001 - any failure to import means this environment cannot run the side
            found = False
        if not found:
            missing.append(name)
    return missing


def require(purpose: str) -> None:
    """Exit with one `error:` line when this Python lacks a package the `purpose` side needs."""
    missing = missing_modules(MODULES[purpose])
    if missing:
        print(f"error: {sys.executable} has no {', '.join(missing)}; use the project's environment: "
              f"{remedy(purpose)}", file=sys.stderr)
        sys.exit(1)


def remedy(purpose: str) -> str:
    """REMEDY[purpose] as it works from the working directory: its paths are the repository's, which a script run
    from elsewhere (cd /tmp && python3 /repo/convert_to_et.py ...) names in full."""
    root = Path(__file__).resolve().parent.parent
    elsewhere = (root / "setup_and_convert.sh").is_file() and Path.cwd().resolve() != root
    return REMEDY[purpose].format(run=f"{root}/" if elsewhere else "./", repo=f"{root}/" if elsewhere else "")


# ---- requirements files ------------------------------------------------------------------------------------------
def _packaging():
    """packaging's Requirement, from the package or from pip's vendored copy (one of them is in every venv)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def unmet_requirements(files: Sequence[Path]) -> List[str]:
    """'<requirement> (installed: <version or none>)' for each requirement of the files this Python lacks
    (requirements whose environment marker excludes this platform are left out)."""
    requirement_class = _packaging()
    unmet = []
    for file in files:
        for line in Path(file).read_text(encoding="utf-8").splitlines():
            line = line.split(" #", 1)[0].split("#", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            if not line or line.startswith("-"):
                continue
            requirement = requirement_class(line)
            if requirement.marker is not None and not requirement.marker.evaluate():
                continue
            try:
                version = metadata.version(requirement.name)
            except metadata.PackageNotFoundError:
                unmet.append(f"{requirement} (installed: none)")
                continue
            if not requirement.specifier.contains(version, prereleases=True):
                unmet.append(f"{requirement} (installed: {version})")
    return unmet


def main(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == "has" and argv[1] in MODULES:
        missing = missing_modules(MODULES[argv[1]], import_them=True)
        if missing:
            print(f"missing: {', '.join(missing)}", file=sys.stderr)
        return 1 if missing else 0
    if len(argv) >= 2 and argv[0] == "check-requirements":
        unmet = unmet_requirements([Path(f) for f in argv[1:]])
        for line in unmet:
            print(f"missing: {line}", file=sys.stderr)
        return 1 if unmet else 0
    print(f"usage: python utils/environment.py has {{{'|'.join(MODULES)}}}\n"
          "       python utils/environment.py check-requirements FILE...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
