"""``model.compile``: each decoder layer torch.compiled (fastrlhf.modeling.compile).

What a GPU run would pay for and a CPU test can see: a wrong gradient (the compiled layers against the eager ones,
through gradient checkpointing and the packed attention's graph break), and a recompile storm (a compiled layer
whose guards fail at every micro-batch or step compiles again each time, and past torch's recompile limit silently
runs eagerly). The RL steps here run with ``aot_eager`` (Dynamo's and AOTAutograd's graphs, no code generation:
what recompiles is decided there); one test compiles a layer with Inductor, the backend a run uses.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from fastrlhf.config import (
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    TrainerConfig,
)
from fastrlhf.modeling import compile as C
from fastrlhf.modeling import load_causal_lm, use_attention
from fastrlhf.modeling.tiny import make_qwen2_on, save_tiny_qwen2

SHAPE = dict(vocab_size=96, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1, intermediate_size=64,
             max_position_embeddings=256, tie_word_embeddings=True)


@pytest.fixture
def dynamo(monkeypatch):
    """A clean Dynamo cache and counters, and the test backend."""
    monkeypatch.setattr(C, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def qwen2(seed=0):
    model = make_qwen2_on("cpu", torch.float32, seed=seed, **SHAPE).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def loss_and_grads(model, batch: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SHAPE["vocab_size"], (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, : length // 3] = 0  # a left-padded row
    loss = model(input_ids=ids, attention_mask=mask).logits.log_softmax(-1).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_compiled_layers_give_the_eager_loss_and_gradients(dynamo):
    eager, compiled = qwen2(), qwen2()
    assert C.compile_layers(compiled) == SHAPE["num_layers"] == C.compiled_layers(compiled)
    assert C.compiled_layers(eager) == 0
    # The module tree and parameter names stay: weight sync, checkpoints and ZeRO see the same model.
    assert list(compiled.state_dict()) == list(eager.state_dict())
    for length in (7, 12, 19):
        want, want_grads = loss_and_grads(eager, 3, length, seed=length)
        got, got_grads = loss_and_grads(compiled, 3, length, seed=length)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert dynamo["stats"]["unique_graphs"] >= 1  # it did run compiled


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ValueError, match="model.compile: Linear has no transformers decoder layers"):
        C.compile_layers(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_inductor_compiles_the_layers_on_this_machine():
    torch._dynamo.reset()
    try:
        eager, compiled = qwen2(), qwen2()
        C.compile_layers(compiled)
        want, want_grads = loss_and_grads(eager, 2, 9, seed=0)
        got, got_grads = loss_and_grads(compiled, 2, 9, seed=0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        torch._dynamo.reset()


def test_the_loader_compiles_what_model_compile_asks_for(dynamo, tmp_path):
    save_tiny_qwen2(str(tmp_path))
    cfg = ModelConfig(path=str(tmp_path), dtype="float32", compile=True)
    actor, reference = load_causal_lm(cfg), load_causal_lm(cfg, trainable=False)
    layers = len(C.decoder_layers(actor))
    assert layers > 0 and C.compiled_layers(actor) == layers and C.compiled_layers(reference) == layers
    plain = load_causal_lm(ModelConfig(path=str(tmp_path), dtype="float32"))
    assert C.compiled_layers(plain) == 0


def rl_steps(compiled: bool, layout: str, steps: int, graphs_after: list):
    """GRPO steps with HF generate sharing the actor (prompts of new lengths each step, so new widths and packed
    rows; shared: each group's prompt once, per-segment sdpa), gradient checkpointing, a frozen reference; the
    actor's parameters after them. ``graphs_after`` collects Dynamo's count of compiled graphs after each step."""
    from fastrlhf.rl.rewards import RewardScorer
    from fastrlhf.rl.step import RLStep
    from fastrlhf.rollout.hf_engine import HFEngine

    actor, reference = qwen2(), qwen2().eval().requires_grad_(False)
    if compiled:
        C.compile_layers(actor)
        C.compile_layers(reference)
    packing, shared = layout != "padded", layout == "shared"
    for model in (actor, reference):
        use_attention(model, packing, shared, "sdpa")
    trainer = TrainerConfig(max_steps=steps, prompts_per_step=2, minibatch_size=4, grad_accum=2, ppo_epochs=1,
                            lr=1e-2, kl_coef=0.05, packing=packing, share_prompts=shared)
    config = TrainConfig(output_dir="unused", model=ModelConfig(path="unused", gradient_checkpointing=True),
                         data=DataConfig(prompts="unused"), trainer=trainer, algorithm="grpo", seed=0,
                         rollout=RolloutConfig(n=2, max_new_tokens=6, max_logprob_mismatch=None),
                         reward=RewardConfig(function="length"))
    # SGD, not Adam: Adam scales the key bias's gradient, zero up to rounding (softmax ignores it), to a full step.
    optimizer = torch.optim.SGD(actor.parameters(), lr=0.5)
    scorer = RewardScorer(lambda prompt, completion, meta: sum(completion) % 7 / 7)  # rewards that differ
    step = RLStep(config, actor, HFEngine(actor), scorer, reference=reference, actor_optimizer=optimizer,
                  pad_token_id=0, rollout_shares_actor=True)
    g = torch.Generator().manual_seed(0)
    for n_step in range(1, steps + 1):
        prompts = [torch.randint(3, SHAPE["vocab_size"], (4 + 3 * n_step + i,), generator=g).tolist()
                   for i in range(2)]
        metrics = step(prompts, None, step=n_step)
        assert metrics["skipped"] == 0 and metrics["optimizer_steps"] == 1, metrics
        graphs_after.append(counters["stats"]["unique_graphs"])
    return {name: p.detach().clone() for name, p in actor.named_parameters()}




def test_packed_rows_of_any_number_of_sequences_reuse_the_graphs(dynamo):
    """The packed attention's host data (a row's sequence bounds) stays out of the compiled layers: rows of
    1 to 6 sequences run the graphs compiled for the first two."""
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rl.forward import sequence_logprobs
    from fastrlhf.rollout import Completion

    model = qwen2().eval()
    C.compile_layers(model)
    use_attention(model, True, False, "sdpa")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (5 + i,), generator=g).tolist() for i in range(6)]
    completions = [[Completion(torch.randint(3, 96, (2 + i % 3,), generator=g).tolist(), [0.0] * (2 + i % 3),
                               "length")] for i in range(6)]
    exp = build_experience(prompts, completions, 0)
    graphs = []
    for rows in range(1, 7):
        sequence_logprobs(model, exp, groups=[list(range(rows))], packed=True)
        graphs.append(dynamo["stats"]["unique_graphs"])
    assert graphs[0] > 0 and len(set(graphs[1:])) == 1, f"graphs compiled after rows of 1..6 sequences: {graphs}"
    assert not C.past_recompile_limit()


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_rl_steps_compile_their_layers_once(dynamo, layout):
    """After two steps every variant a step needs is compiled (train, the checkpointed recompute, no-grad passes,
    the frozen reference; static then dynamic shapes): later steps of other lengths add no graph, none runs
    eagerly past the recompile limit (HF generate, whose KV cache would make each layer a recompile, runs them
    eagerly on purpose), and the weights come out as the eager run's."""
    graphs = []
    got = rl_steps(True, layout, 4, graphs)
    assert graphs[0] > 0, "the layers did not run compiled"
    assert graphs[1] == graphs[2] == graphs[3], f"graphs compiled after each step: {graphs}"
    assert not C.past_recompile_limit()  # generate (a KV cache: every layer a recompile) ran the layers eagerly
    torch._dynamo.reset()
    want = rl_steps(False, layout, 4, [])
    start = dict(qwen2().named_parameters())
    assert max(float((want[name] - p).abs().max()) for name, p in start.items()) > 1e-3  # the steps trained
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_the_packed_attention_is_never_traced_and_what_it_compiles_still_compiles(dynamo):
    """The registered packed attention is out of Dynamo's reach, and a torch.compile'd function it calls (the flex
    backend's FlexAttention on CUDA) still compiles there: once, for inputs of any size, as in a plain run."""
    from torch._dynamo.testing import CompileCounter
    from transformers import AttentionInterface

    from fastrlhf.sequences import packed_attention as PA

    registered = AttentionInterface()[PA.register()]
    assert registered is not PA.packed_attention and getattr(registered, "_torchdynamo_disable", False)
    inner, outer = CompileCounter(), CompileCounter()
    compiled_inner = torch.compile(lambda x: torch.sin(x) * 2, backend=inner, dynamic=True)
    attention = torch.compiler.disable(lambda x, rows: compiled_inner(x[: rows.bounds[-1]]).sum() + x.sum())
    layer = torch.compile(lambda x, rows: (torch.cos(x) + 1) * attention(torch.cos(x) + 1, rows), backend=outer,
                          dynamic=True)
    for n in (3, 4, 5, 6):  # host data passed through the layer as the trainer passes it: in a PackedRows
        layer(torch.randn(8), PA.PackedRows(list(range(n)), None, torch.arange(n)))
    assert inner.frame_count == 1 and outer.frame_count == 2  # the layer: before and after the attention
