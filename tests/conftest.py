import pytest

from fuyou_strategy import FuyouConfig


@pytest.fixture
def small_config(tmp_path):
    """A config with small chunks so tiny tensors still span several chunks."""
    return FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", io_block_size="4KiB",
                       host_memory_budget="256KiB", io_threads=3)
