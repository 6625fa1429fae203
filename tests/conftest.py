import contextlib
import os
import threading
from pathlib import Path

import pytest

from launch.raycluster import descendants
from tests.s3server import keep_session_environment, s3_endpoint  # noqa: F401

# The suite runs on two pytest-xdist workers (pyproject's addopts: `-n 2 --dist loadgroup`). Two local Ray instances
# on one machine confuse Ray Train, so every test that can start Ray is in one xdist group, "ray", which one worker
# runs in order while the other runs the rest. A test is in that group when its module is not named here, or when it
# is marked `@pytest.mark.ray` in a module that is: these modules start no Ray elsewhere (`ray_started_below` fails a
# test outside the group that does). A test of a module not named here that starts no Ray (a docs block that trains
# locally) is marked `@pytest.mark.outside_ray_group` and runs beside the group, watched the same way.
# What confuses Ray Train is a second Ray that a process can mistake for its own. Ray's state API, given no address,
# takes the one in /tmp/ray/ray_current_cluster (written by a `ray start` with the default temp folder), else the
# machine's one GCS process, and refuses to pick between two; Train's placement-group cleaner asks it whether a dead
# trial's controller is alive, so the retry of that trial waits forever for the CPUs its placement group still holds.
# A dashboard takes the port (8265) the next one and `ray job submit` expect. The test clusters' processes carry their
# own address (`tests.raycluster.LocalCluster`: RAY_ADDRESS), and a local Ray that a2 starts for one-worker trials
# (address "local", every port picked free, no dashboard where no trial runs on Ray Train) leaves nothing to mistake:
# tests that start only such Rays are marked `@pytest.mark.ray_beside` and form a second group, "ray-beside", which
# the other worker runs first, beside the "ray" group; `ray_started_below` fails one whose Ray has a dashboard. The
# two groups are the suite's two longest paths: together on one worker they were its whole length.
WITHOUT_RAY = {
    "test_a2_objective", "test_adaptive_replicates", "test_dashboards_seeds_and_extremes", "test_decode_empty_and_lr",
    "test_progress_edges", "test_progress_within_epoch", "test_docs_claims", "test_docs_claims_studies",
    "test_local_commands_more", "test_cli_hygiene", "test_study_check_edges", "test_checksum_damaged", "test_report_compare_edges", "test_checkpoint_paths", "test_lease_edges", "test_mlflow_export_more", "test_lease_heartbeat", "test_diagnostics_edges", "test_adapters", "test_atomic_folder", "test_beam_exhaustive", "test_progress_values", "test_recipe_against_m2", "test_reporting_values", "test_plan_by_hand", "test_stats_against_scipy", "test_beam_compaction", "test_bench_asha", "test_bench_data", "test_bench_decode",
    "test_bench_noise", "test_best_epoch", "test_calibration", "test_checkpoint", "test_checkpoint_windows", "test_cider_reference", "test_cli",
    "test_cli_grammar", "test_cli_train", "test_cli_words", "test_cluster_config", "test_cluster_sync", "test_compare", "test_compute", "test_conclusions",
    "test_confirmation_seeds",
    "test_data", "test_data_kill_windows", "test_data_hostile", "test_dashboards_edges", "test_data_kind_keys", "test_decode_edges", "test_submission_edges", "test_submission_tokenizer", "test_datastore", "test_datastore_edges", "test_diagnostics", "test_diagnostics_reference", "test_divergence", "test_docs", "test_ensemble", "test_frames",
    "test_epochs_once", "test_fetch_kill_windows", "test_fused", "test_global_batch", "test_hostile_inputs", "test_import_graph", "test_lease",
    "test_leaderboard", "test_local_commands_hostile", "test_lost_trials", "test_metrics", "test_mlflow_export", "test_mlflow_export_edges", "test_mlflow_deleted_midway", "test_mlflow_ui", "test_model",
    "test_package", "test_package_resume", "test_package_transactional", "test_plan", "test_plan_arithmetic", "test_plan_edges",
    "test_prepared", "test_probe_faults", "test_read_side_hostile", "test_progress", "test_recipe", "test_run_start_checks", "test_record", "test_record_checks", "test_records", "test_rehearse", "test_report", "test_result_log",
    "test_s3", "test_scst", "test_scst_ranks", "test_search", "test_secrets", "test_spec", "test_state_copies", "test_state_errors",
    "test_space_applicability", "test_stats", "test_study_completion", "test_study_output", "test_study_plan",
    "test_study_sizes",
    "test_study_root", "test_submission", "test_validate_copies", "test_validate_storage", "test_superseded", "test_tracking", "test_train", "test_train_resume_checks", "test_trial_shape",
}
RAY_PROCESSES = {"raylet", "gcs_server"}
BESIDE = "ray-beside"
DASHBOARD_PREFIX = "ray-dashboard-"  # the title of each of a Ray dashboard's head modules (its HTTP server's)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    in_group = set()
    for item in items:
        in_ray_module = Path(str(item.fspath)).stem not in WITHOUT_RAY
        if item.get_closest_marker("ray_beside") is not None:
            item.add_marker(pytest.mark.xdist_group(BESIDE))
            in_group.add(item.nodeid)
        elif (in_ray_module and item.get_closest_marker("outside_ray_group") is None
                or item.get_closest_marker("ray") is not None):
            item.add_marker(pytest.mark.xdist_group("ray"))
            in_group.add(item.nodeid)
    if "PYTEST_XDIST_WORKER" in os.environ:
        # The group first: xdist's loadgroup hands out work units in collection order, one at a time to a worker with
        # at most two tests pending, so the group's worker would first run its share of every test collected before
        # the group's first one (minutes, on the suite's longest path); first in the queue, the group starts at once
        # and the other worker runs everything else beside it. The same order on every worker, as xdist requires.
        items.sort(key=lambda item: item.nodeid not in in_group)


@pytest.fixture(autouse=True)
def _one_torch_thread_beside_the_ray_group(request):
    """Under pytest-xdist, a test outside the "ray" group runs beside the group's studies on a 2-core machine: one
    torch thread for it, so that the studies' own processes keep a core (two threads made the Ray tests that ran beside
    it up to half again slower)."""
    if "PYTEST_XDIST_WORKER" not in os.environ or request.node.get_closest_marker("xdist_group") is not None:
        yield
        return
    omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # its subprocesses' too
    with torch_threads(1):  # the worker outside the group trains models anyway: torch is imported once
        yield
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp


def pytest_configure(config):
    """Before the workers start: the token file of Ray's token authentication, which a local `ray.init` writes when it
    finds none (~/.ray/auth_token). Two groups starting Rays at once on a machine without one could each write their
    own, and a Ray whose token was overwritten refuses its next worker."""
    if hasattr(config, "workerinput") or (Path.home() / ".ray" / "auth_token").exists():
        return
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)


@pytest.fixture(autouse=True)
def ray_started_below(request):
    """A test outside the Ray groups that starts a Ray (a raylet or GCS below this process, seen twice a second)
    fails: it could have run beside a Ray test of the other worker. So does a test of the "ray-beside" group whose Ray
    has a dashboard: it would take the port the "ray" group's next dashboard expects."""
    marker = request.node.get_closest_marker("xdist_group")
    group = marker.args[0] if marker is not None else None
    if group == "ray":
        yield
        return
    watched = RAY_PROCESSES if group is None else set()
    seen: set[str] = set()
    done = threading.Event()

    def watch():
        while not done.wait(0.5):
            for pid in descendants(os.getpid()):
                try:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                if name in watched or group == BESIDE and name.startswith(DASHBOARD_PREFIX):
                    seen.add(name)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield
    done.set()
    watcher.join()
    if group == BESIDE:
        assert not seen, (f"{request.node.nodeid} started a Ray with a dashboard ({', '.join(sorted(seen))}): it "
                          f"cannot run beside the \"ray\" group; mark it @pytest.mark.ray instead of ray_beside")
    assert not seen, (f"{request.node.nodeid} started Ray ({', '.join(sorted(seen))}): its module must leave "
                      f"tests/conftest.py's WITHOUT_RAY, or be marked @pytest.mark.ray")


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to `n` for the block, put back after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of many small torch computations: on two cores shared with other jobs, one intra-op thread is
    far faster than two fighting for them. Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    with torch_threads(1):
        yield


@pytest.fixture(autouse=True)
def _environment_restored():
    """Commands run in-process change os.environ on purpose (launch.raycluster.connect moves AWS keys into a
    credentials file and points AWS_PROFILE at it, for the life of that process): each test starts from the
    environment the one before it started from, plus what a session fixture started during it set."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    keep_session_environment()
