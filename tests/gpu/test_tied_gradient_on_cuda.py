"""The tied embedding's gradient through the handoff (fastrlhf.modeling.tied_gradient) sums a token's many lookups
in fp32 and rounds once, as nn.Embedding's own backward does, on CUDA (where index_add_'s bf16 atomics round per
lookup) and on the CPU (its half, run by `make test`)."""

import pytest
import torch

from fastrlhf.modeling.tied_gradient import tied_gradient_handoff

V, H = 16, 64


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
def device(request) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: run `make test-gpu` on a GPU machine")
    return request.param


def test_a_token_looked_up_thousands_of_times_gets_its_lookups_summed_in_fp32(device):
    """A micro-batch of 4,096 tokens, 3,510 of them one token (a space, a newline): in bf16 each of its lookups
    rounded on CUDA (index_add_'s atomics; those roundings done on a CPU: 8% of the rows' norm off, the bound
    4e-3), where nn.Embedding's own backward sums them in fp32 and rounds once."""
    g = torch.Generator().manual_seed(0)
    embedding = torch.nn.Embedding(V, H).to(device, torch.bfloat16)
    head = torch.nn.Linear(H, V, bias=False).to(device, torch.bfloat16)
    head.weight = embedding.weight
    ids = torch.zeros(4096, dtype=torch.long)
    ids[::7] = 5
    lookup_grad = (torch.randn(4096, H, generator=g) * 1e-3 + 2e-4).to(device, torch.bfloat16)
    x = torch.randn(32, H, generator=g).to(device, torch.bfloat16)
    c = torch.randn(32, V, generator=g).to(device, torch.bfloat16)
    ids = ids.to(device)

    head_only = torch.autograd.grad((torch.nn.functional.linear(x, head.weight) * c).sum(), head.weight)[0]
    with tied_gradient_handoff(embedding, head) as head_weight:
        loss = (embedding(ids) * lookup_grad).sum() + (torch.nn.functional.linear(x, head_weight()) * c).sum()
    loss.backward()

    want = head_only.double().index_add(0, ids, lookup_grad.double())
    rows = [0, 5]
    err = ((embedding.weight.grad.double() - want)[rows].norm() / want[rows].norm()).item()
    assert err < 4e-3, f"relative error of the looked-up rows {err:.3e} (one bf16 rounding is ~2e-3)"
