import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_configuration():
    """Each test starts unconfigured (configure() may be called once per process)."""
    from weightstream import config
    from weightstream.runtime import executor

    config._reset_for_tests()
    executor._reset_for_tests()
    yield
    config._reset_for_tests()
    executor._reset_for_tests()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
