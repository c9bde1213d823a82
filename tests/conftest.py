import pytest
import torch

import shoal
import shoal.graph.passes

HOME = shoal.init(devices=4)
torch.set_num_threads(1)
shoal.graph.passes.VERIFY_EACH_PASS = True  # a pass that breaks the graph is named


@pytest.fixture(scope="session")
def meshes():
    """The oracle meshes: (1,), (2,), (3,), (2,2) over a world of 4 virtual devices."""
    return {
        (1,): shoal.Mesh([0]),
        (2,): shoal.Mesh([0, 1]),
        (3,): shoal.Mesh([0, 1, 2]),
        (2, 2): shoal.Mesh([[0, 1], [2, 3]], axes=("dp", "tp")),
    }


@pytest.fixture(autouse=True)
def _home_world():
    """Every test starts in the world of 4 virtual devices: one that makes another (``shoal train
    --devices 2`` in process, a memory budget) must not change the meshes of the tests after it on
    the same worker."""
    yield
    if shoal.world() != HOME:
        shoal.init(devices=4)
