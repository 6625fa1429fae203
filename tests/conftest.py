import os

import pytest

from tests.s3server import keep_session_environment, s3_endpoint  # noqa: F401


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of many small torch computations: on two cores shared with other jobs, one intra-op thread is
    far faster than two fighting for them. Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
