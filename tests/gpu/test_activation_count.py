"""What autograd keeps per token in one decoder layer of the proof's model, against the memory plan's count of it
(``ModelShape.layer_activation_bytes_per_token``): bf16, with the RL batch's padding mask and without one, on
CUDA at the 1.5B shape and on the CPU at the tiny one. Read from the autograd graph (every node's saved tensors,
by storage, parameters left out), as the difference between a model of two layers and one of one layer, so that
what every layer shares (RoPE's cos and sin, the mask) cancels.

On a CPU the count is exact with a padding mask (HF's SDPA path then repeats k and v over the heads and copies
the attention output for o_proj) and over without one (neither happens). The GPU half says which holds for
CUDA's attention kernels: the plan may be 3% under at most (the kernels' own small saved tensors) and 15% over."""

import pytest
import torch
from helpers.proof import model_shape

from fastrlhf.memory import read_shape
from fastrlhf.modeling.tiny import make_qwen2_on

BATCH, LENGTH = 4, 128


def saved_bytes(model, ids: torch.Tensor, mask: torch.Tensor | None) -> int:
    """The bytes of the distinct tensors the forward's autograd graph keeps for the backward (parameters left out)."""
    inputs = model.model.embed_tokens(ids).detach().requires_grad_()
    out = model.model(inputs_embeds=inputs, attention_mask=mask, use_cache=False).last_hidden_state
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept, stack, seen = {}, [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:  # a saved value already freed
                    continue
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    storage = value.untyped_storage()
                    if storage.data_ptr() not in params:
                        kept[storage.data_ptr()] = storage.nbytes()
        stack += [f for f, _ in node.next_functions]
    return sum(kept.values())


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_the_plan_counts_what_a_layer_keeps_for_the_backward(where, padded, tmp_path):
    device = torch.device("cuda", torch.cuda.current_device()) if where == "cuda" else torch.device("cpu")
    shape = model_shape(where)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, shape["vocab_size"], (BATCH, LENGTH), generator=g).to(device)
    mask = None
    if padded:
        mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
        mask[0, : LENGTH // 4] = 0  # a left-padded prompt, as the RL batch holds them
        mask = mask.to(device)
    kept = {}
    for layers in (1, 2):
        model = make_qwen2_on(device, torch.bfloat16, seed=0, **dict(shape, num_layers=layers)).train()
        if layers == 1:
            model.config.save_pretrained(tmp_path)  # config.json only: what the plan reads the shape from
        kept[layers] = saved_bytes(model, ids, mask)
        del model
    measured = (kept[2] - kept[1]) / (BATCH * LENGTH)
    planned = read_shape(str(tmp_path)).layer_activation_bytes_per_token(2)
    print(f"\n{where} {'padded' if padded else 'unpadded'}: a layer keeps {measured:,.0f} B per token, "
          f"the plan counts {planned:,} ({planned / measured:.3f}x)")
    assert 0.97 <= planned / measured <= 1.15, (planned, measured)
    if where == "cpu" and padded:
        assert abs(planned / measured - 1) < 0.01, (planned, measured)
