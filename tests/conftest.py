import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_configuration():
    """Each test starts unconfigured (configure() may be called once per process)."""
    from weightstream import config, executor

    config._reset_for_tests()
    executor._reset_for_tests()
    yield
    config._reset_for_tests()
    executor._reset_for_tests()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _quick_machine_profile(monkeypatch, tmp_path_factory):
    """Compile phases in tests measure the machine with tiny sizes, cached per session."""
    cache = tmp_path_factory.getbasetemp() / "weightstream-cache"
    monkeypatch.setenv("WEIGHTSTREAM_CACHE_DIR", str(cache))
    monkeypatch.setenv("WEIGHTSTREAM_QUICK_MACHINE_PROFILE", "1")
    yield
