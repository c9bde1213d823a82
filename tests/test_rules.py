"""Every registered rule, every signature it offers, on every oracle mesh, against plain torch."""

import pytest

from shoal.ops import lookup, registered_ops
from shoal.ops.validate import SAMPLES, ops_to_validate, validate_op


def test_every_registered_op_has_samples():
    missing = [str(op) for op in registered_ops() if op not in SAMPLES]
    assert not missing, f"registered ops without validator samples: {missing}"


def test_every_sample_has_a_rule():
    assert all(lookup(op) is not None for op in SAMPLES)


@pytest.mark.parametrize("op", ops_to_validate(), ids=str)
def test_rule_matches_single_device(op, meshes):
    total, failures = 0, []
    for mesh in meshes.values():
        n, f = validate_op(op, mesh)
        total += n
        failures += f
    assert total > 0, f"{op}: no signature was checked"
    assert not failures, "\n".join(failures[:10])
