import os

import pytest
import torch

# Without a GPU, the Triton kernels run in the interpreter. TRITON_INTERPRET is read
# when triton is imported (lazily, by models.ops at the first kernel launch, never by
# `import torch`), so it is set here, before any test module runs. With CUDA the real
# kernels run and tests/test_triton_ops.py checks them on the device.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
