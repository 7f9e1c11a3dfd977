"""Shared test helpers: where the repository and the team's reference traces are."""
import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"

# torchrun started by the tests (`python -m torch.distributed.run`) writes its per-rank folders nowhere (its --log-dir
# from the environment): it had left a /tmp/torchelastic_* folder for each of the suite's ~30 multi-rank runs.
# utils.torchrun's own folder is tested with this unset (tests/test_faults_training.py).
os.environ.setdefault("PET_LOG_DIR", os.devnull)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_fixtures() -> Path:
    """../shared/fixtures beside the clone; tests that need it skip in a user's clone."""
    if not SHARED_FIXTURES.is_dir():
        pytest.skip(f"{SHARED_FIXTURES} not found: the reference traces live beside the team's clones, not in the repository")
    return SHARED_FIXTURES


def require_astra_sim() -> Path:
    """ASTRA-sim's analytical binary ($ASTRA_SIM), or a skip that says how to get it: it is not part of a clone."""
    path = os.environ.get("ASTRA_SIM", "")
    if not (path and Path(path).is_file() and os.access(path, os.X_OK)):
        pytest.skip("ASTRA-sim not built: set $ASTRA_SIM to the binary ./install_astra_sim.sh prints")
    return Path(path)


@pytest.fixture(scope="session")
def astra_sim() -> Path:
    """ASTRA-sim's analytical binary; tests that run it skip where it is not built."""
    return require_astra_sim()


@pytest.fixture(scope="session")
def gpt2_run(tmp_path_factory) -> Path:
    """The bundled 2-rank GPT-2 DDP trace (with its run.json), converted in its own folder: gpt2_tiny_2r.{0,1}.et.
    Tests read it and write elsewhere."""
    import shutil

    from conversion_helpers import CPU_FIXTURES
    from trace_tools.discover import find_runs
    from trace_tools.pipeline import convert_runs
    folder = tmp_path_factory.mktemp("scale_source") / "gpt2_tiny_2r"
    shutil.copytree(CPU_FIXTURES / "gpt2_tiny_2r", folder)
    result = convert_runs(find_runs([folder]), jobs=2, progress=False)[0]
    assert result.ok, [r.error for r in result.ranks]
    return folder


# ---- the quick subset: -m "not slow" ------------------------------------------------------------------------------
# Under 2 minutes on 2 cores: it leaves out whatever trains a model, starts the launchers, installs packages, runs
# the documentation's commands, or reads the large reference traces. Tests mark themselves slow one by one; the
# groups below are marked here, so one look shows everything the quick subset skips and why.
SLOW_MODULES = {
    "test_training.py": "trains the tiny models, in this process and under torchrun",
    "test_launchers.py": "runs the launchers, which start training runs",
    "test_bench.py": "runs the benchmarks",
    "test_own_training_loop.py": "trains and traces an MLP under torchrun",
}
SLOW_FIXTURES = {
    "filled_venv": "installs the conversion packages into a new environment",
    "chakra_venv": "installs the conversion packages, then runs the documentation's commands in a clone",
    "shared_fixtures": "reads the team's reference GPU traces (8 ranks, hundreds of MB)",
    "cpu_reports": "converts and reports on the bundled runs",
    "gpu_reports": "converts and reports on the reference GPU traces",
    "run_dir": "converts and reports on the bundled runs and the reference GPU traces",
    "one_rank_gpt2": "trains and traces a tiny GPT-2",
}
SLOW_TESTS = {
    "test_dockerfile_import_check_passes_in_a_complete_environment": "imports the whole training side in a new process",
    "test_tokenizer_download_offline_warns_and_lets_the_build_go_on": "imports transformers in a new process",
    "test_tokenizer_download_strict_fails_when_a_tokenizer_is_missing": "imports transformers in a new process",
    "test_tokenizer_download_saves_a_loadable_tokenizer": "imports transformers in a new process",
    "test_truncation_anywhere_keeps_exactly_the_complete_nodes": "repairs one trace truncated at every node",
    "test_one_rank_traced_gpt2_step_has_no_trainer_bookkeeping": "trains and traces a tiny GPT-2",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = getattr(item, "originalname", item.name)
        if item.path.name in SLOW_MODULES or name in SLOW_TESTS or SLOW_FIXTURES.keys() & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


# ---- tests that measure the whole machine: -m alone -----------------------------------------------------------------
# ./run_tests.sh runs one pytest-xdist worker per CPU. A test marked `alone` (it accounts for every thread's time on
# the machine) runs with no other worker's test beside it: every test holds a shared lock while it runs (its fixtures
# too), an `alone` one the exclusive lock; a turnstile lets a waiting `alone` test in before further shared ones.
def _lock_path(kind: str, controller_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"mosim-tests-{controller_pid}.{kind}"


@contextlib.contextmanager
def _beside_other_workers(config, alone: bool):
    if not hasattr(config, "workerinput"):  # not an xdist worker: nothing runs beside a test
        yield
        return
    controller = os.getppid()  # the workers' parent: one pair of lock files a run
    with open(_lock_path("turnstile", controller), "a") as turnstile, open(_lock_path("lock", controller), "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _beside_other_workers(item.config, alone=item.get_closest_marker("alone") is not None):
        yield


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without workers), once its workers are done
        for kind in ("turnstile", "lock"):
            _lock_path(kind, os.getpid()).unlink(missing_ok=True)


@pytest.fixture
def toy_family(tmp_path):
    """A third model family, `toy`, registered for one test: a folder (GPT-2's code under another name) and one
    registry line (tests/toy_family.py). Yields its FamilyInfo; the registry and sys.path are restored after."""
    from toy_family import add_toy_family, remove_toy_family
    root = tmp_path / "families"
    try:
        yield add_toy_family(root)
    finally:
        remove_toy_family(root)
