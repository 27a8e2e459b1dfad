import os

import pytest
import torch

from . import background
from .background import QUICKSTART_TEST

# Without a GPU, the Triton kernels run in the interpreter. TRITON_INTERPRET is read
# when triton is imported (lazily, by models.ops at the first kernel launch, never by
# `import torch`), so it is set here, before any test module runs. With CUDA the real
# kernels run and tests/integration/test_triton_ops.py checks them on the device.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


#: the first phase's longest files (docs/design.md, "CI's time"), run before the rest
FIRST = ("tests/integration/test_loop.py", "tests/integration/test_rollout_live.py",
         "tests/integration/test_promotion_live.py", "tests/system/test_wheel.py")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    # The tests that run the container images go last (stably ordered), after the
    # quickstart's: their build and its training run beside the other tests
    # (pytest_collection_finish starts them).
    # The longest tests of the first phase (the Makefile's BESIDE) go first, so that its two
    # workers do not end on them one after the other, and the unit tests (short, each
    # computing all the time) last: they fill the cores while the other worker ends on a
    # test that waits on servers (the first phase's last two minutes were a quarter idle
    # with the unit tests first).
    def rank(item) -> int:  # a stable sort: each group keeps its collection order
        if "containers" in item.keywords:
            return 4
        if item.nodeid.endswith(QUICKSTART_TEST):
            return 3
        if item.nodeid.split("::")[0] in FIRST:
            return 0
        return 2 if item.nodeid.startswith("tests/unit/") else 1

    items.sort(key=rank)


def pytest_collection_finish(session):
    """Start the image build (tests/containers.py) when a test still selected after -m and
    -k deselection runs an image (it uses the `engine` fixture), and the quickstart's
    training when its test is selected (tests/background.py)."""
    if any("engine" in getattr(item, "fixturenames", ()) for item in session.items):
        from .containers import start_build

        start_build()
    if any(item.nodeid.endswith(QUICKSTART_TEST) for item in session.items):
        background.start_quickstart()


def pytest_sessionfinish(session):
    from .containers import stop_build

    stop_build()
    background.stop()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    # One intra-op thread for what a test computes in its own process (the commands it
    # starts choose theirs). Two test workers, each with torch's default of a thread per
    # core, oversubscribe a 2-core machine: OpenMP's threads then spin at every barrier
    # for a sibling that is not running. tests/unit/models beside two busy processes took
    # 39 s of CPU with the default and 20 s with one thread (docs/design.md, "CI's time");
    # an in-process training that picks its own count (train(threads=None)) still does.
    torch.set_num_threads(1)


# -- what users install: the wheel, built once per test session (tests/artifacts.py) -----

@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """The orthornn wheel of this checkout (built from a copy of a clone's files with pip,
    the way a user builds it). pip without an index skips, or fails under
    CI_TOOLS_STRICT=1."""
    from .artifacts import Unavailable, build_wheel, skip_or_fail

    try:
        return build_wheel(tmp_path_factory.mktemp("wheel"))
    except Unavailable as error:
        skip_or_fail(str(error))


# -- the inference service: model packages made once per test session ------------------

@pytest.fixture(scope="session")
def service_packages(tmp_path_factory):
    """A staging repository of exported packages (tests/background.py,
    ``build_service_packages``): adding (5 versions), digits and words. Tests copy what
    they need. Under make test, built once for both phases by its background job."""
    return background.service_packages(tmp_path_factory.mktemp("service-packages"))
