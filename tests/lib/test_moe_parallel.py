"""lib.moe_parallel: two CPU processes (gloo on 127.0.0.1), each owning half the experts, compute
what one process computes with the whole layer: outputs, input gradients, expert and router
gradients. One launch per case (spawning two Python processes costs seconds)."""

import pytest
import torch
import torch.distributed as dist

from lib.moe_parallel import run_expert_parallel, single_process_reference

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def _assert_matches_one_process(result):
    ref = single_process_reference(result)
    # The outputs and input gradients are computed from the same rows by the same per-expert matmuls
    # in the same order, so they agree to fp32 round-off (they come out bit-equal here; 1e-6 leaves
    # room for BLAS thread-count differences). The router gradient is a sum over the two ranks' tokens,
    # added in another order (all_reduce of two partial sums): a few ulps of O(1) values.
    torch.testing.assert_close(result.y, ref["y"], atol=1e-6, rtol=0)
    torch.testing.assert_close(result.x_grad, ref["x_grad"], atol=1e-6, rtol=0)
    assert set(result.grads) == set(ref["grads"])
    for name in ref["grads"]:
        torch.testing.assert_close(result.grads[name], ref["grads"][name], atol=1e-5, rtol=0, msg=name)


def test_two_process_expert_parallel_equals_one_process_forward_and_gradients():
    result = run_expert_parallel(2, d_model=16, d_ff=32, num_experts=4, top_k=2, batch_per_rank=2, seq_len=8, seed=0)
    _assert_matches_one_process(result)
    assert result.y.shape == (4, 8, 16)
    # bytes measured: each rank sends the other its rows for the other's experts (16 floats each)
    # and gets its own tokens' results back, plus the (E,) int64 counts; what goes out comes back
    for r, b in enumerate(result.bytes):
        other = result.rows_sent[r][1 - r]
        received = result.rows_sent[1 - r][r]
        assert b["forward_sent"] == (other + received) * 16 * 4 + 2 * 8
        assert b["backward_sent"] == (other + received) * 16 * 4
        assert b["forward_received"] == b["forward_sent"]


def test_expert_parallel_with_idle_experts_and_swiglu():
    # 2 tokens per rank, top-1 of 8 experts: most experts, and possibly a whole rank, get no rows
    result = run_expert_parallel(
        2,
        d_model=8,
        d_ff=16,
        num_experts=8,
        top_k=1,
        activation="swiglu",
        gating="softmax_topk_raw",
        batch_per_rank=1,
        seq_len=2,
        seed=1,
    )
    _assert_matches_one_process(result)


def test_expert_parallel_bad_arguments():
    with pytest.raises(ValueError, match=r"num_experts \(3\) must be divisible by world_size \(2\)"):
        run_expert_parallel(2, num_experts=3, top_k=1)
    with pytest.raises(ValueError, match="top_k must be <= num_experts"):
        run_expert_parallel(2, num_experts=2, top_k=3)
