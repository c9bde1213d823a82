"""The one schema reader (shoal.schema): written arguments, tensor lists, in-place returns, views."""

import torch

from shoal import schema

aten = torch.ops.aten


def test_written_tensor_lists_write_every_element():
    # _foreach_add_(self: Tensor(a!)[], other: Tensor[]): no alias set on a list, still written
    mutated, rets = schema.mutated(aten._foreach_add_.List, [(0, 1), (2, 3), ()])
    assert mutated == (0, 1) and rets == []
    fused = schema.mutated(aten._fused_adamw_.default, [(0,), (1,), (2,), (3,), ()] + [()] * 8 + [(4,), ()])[0]
    assert fused == (0, 1, 2, 3)  # with a grad_scale: the gradients are unscaled in place


def test_fused_adam_reads_its_gradients_without_a_grad_scale():
    """The schema marks ``grads`` written; ATen's kernel stores them only to unscale them."""
    by_arg = [(0,), (1,), (2,), (3,), ()] + [()] * 9
    assert schema.mutated(aten._fused_adamw_.default, by_arg)[0] == (0, 2, 3)
    assert schema.mutated(aten._fused_adam_.default, by_arg)[0] == (0, 2, 3)
    for fused in (torch._fused_adam_, torch._fused_adamw_):
        for scale in (None, torch.tensor(2.0)):
            g = torch.randn(5)
            before = g.clone()
            fused([torch.randn(5)], [g], [torch.zeros(5)], [torch.zeros(5)], [], [torch.tensor(1.0)], lr=0.1,
                  beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=True, grad_scale=scale,
                  found_inf=None if scale is None else torch.tensor(0.0))
            assert torch.equal(g, before) == (scale is None), (fused, scale)


def test_in_place_and_out_results_are_their_written_inputs():
    assert schema.mutated(aten.add_.Tensor, [(0,), (1,), ()]) == ((0,), [0])
    assert schema.mutated(aten.add.out, [(0,), (1,), (), (2,)]) == ((2,), [2])
    assert schema.mutated(aten.add.Tensor, [(0,), (1,), ()]) == ((), [None])


def test_views_and_names():
    assert schema.of(aten.transpose.int).view and not schema.of(aten.reshape.default).view  # composite
    assert not schema.of(aten.add_.Tensor).view and schema.of(aten.add_.Tensor).written == ((0, "self"),)
    assert schema.bind(aten.sum.dim_IntList, ("x", [1]), {"keepdim": True}) == {
        "self": "x", "dim": [1], "keepdim": True, "dtype": None}
