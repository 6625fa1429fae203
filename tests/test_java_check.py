"""Before a study's first trial, a node without Java is named in one line when the study reports METEOR
(launch.datastore.java_warnings): Ray's images have no Java, and a trial there would silently drop test/METEOR."""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from launch.datastore import java_warnings

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_without_java():
    """A one-node Ray whose processes see a PATH without `java` (only this Python's own folder)."""
    import ray

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", str(Path(sys.executable).parent))
        mp.setenv("RAY_AUTH_MODE", "disabled")
        temp = tempfile.mkdtemp(prefix="a2java-", dir="/tmp")  # short: Ray's socket paths live below it
        ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False, _temp_dir=temp)
        try:
            yield
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


def test_a_node_without_java_is_named_when_the_study_reports_meteor(ray_without_java):
    [line] = java_warnings({"test_meteor": True, "val_meteor": False})
    assert "has no Java: test/METEOR cannot be computed there" in line
    assert "\n" not in line
    [line] = java_warnings({"test_meteor": True, "val_meteor": True})
    assert "test/METEOR and val/METEOR" in line


def test_nothing_is_said_when_the_study_reports_no_meteor(ray_without_java):
    assert java_warnings({"test_meteor": False, "val_meteor": False}) == []
