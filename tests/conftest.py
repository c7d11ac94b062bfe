import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_run():
    """Each test starts in a fresh run context (Note [run context]): unconfigured
    (configure() may be called once per run), at step 0, half type float16."""
    from weightstream.context import start_run

    start_run()
    yield
    start_run()


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
