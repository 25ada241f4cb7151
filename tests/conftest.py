import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def one_process_group():
    """A test in which Lightning initialises a process group of one in this process: destroyed afterwards, and the
    environment variables it set taken back."""
    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
