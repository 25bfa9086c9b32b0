"""SFT and reward-model training on DeepSpeed engines (CPU, gloo): loss, accuracy, export, exact resume,
the step guard inside an engine, and a 2-rank run under the deepspeed launcher."""

import json
import os
import random
import shutil
import signal
import sys

import pytest
import torch
import yaml
from helpers.launch import run_group
from helpers.paths import ROOT

from fastrlhf.distributed import free_port
from fastrlhf.engine.deepspeed import build_frozen_engine, build_train_engine, deepspeed_config
from fastrlhf.engine.metrics import read_metrics
from fastrlhf.modeling.tiny import save_tiny_llama

pytestmark = pytest.mark.slow

VOCAB = 64
ENV = {**os.environ, "FASTRLHF_DIST_TIMEOUT": "60", "FASTRLHF_NO_PROGRESS": "1", "PYTHONUNBUFFERED": "1"}
DETERMINISTIC_KEYS = ("loss", "grad_norm", "lr", "response_tokens", "skipped_total")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_rm")
    save_tiny_llama(root / "model", vocab_size=VOCAB, hidden_size=64, num_layers=1)
    rng = random.Random(0)
    with open(root / "sft.jsonl", "w") as f:
        for _ in range(8):
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 6))]
            f.write(json.dumps({"prompt_ids": prompt, "response_ids": [(t * 7) % 61 + 3 for t in prompt]}) + "\n")
    with open(root / "pairs.jsonl", "w") as f:  # chosen: low token ids, rejected: high ones
        for _ in range(16):
            f.write(json.dumps({"prompt_ids": [rng.randrange(3, VOCAB) for _ in range(3)],
                                "chosen_ids": [rng.randrange(3, 20) for _ in range(4)],
                                "rejected_ids": [rng.randrange(44, VOCAB) for _ in range(4)]}) + "\n")
    with open(root / "cls.jsonl", "w") as f:
        for i in range(16):
            lo, hi = (3, 20) if i % 2 == 0 else (44, VOCAB)
            f.write(json.dumps({"input_ids": [rng.randrange(lo, hi) for _ in range(5)], "label": i % 2}) + "\n")
    return root


def write_config(workdir, name, **sections):
    raw = {"output_dir": str(workdir / name), "model": {"path": str(workdir / "model")},
           "data": {"path": str(workdir / "sft.jsonl"), "max_len": 32},
           "trainer": {"max_steps": 8, "batch_size": 8, "lr": 1.0e-2}, "deepspeed": {"zero_stage": 2}}
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(raw.get(key), dict) else value
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def cli(*args, timeout=180):
    return run_group([sys.executable, "-m", "fastrlhf", *args], timeout, env=ENV)


def losses(output_dir):
    return [r["loss"] for r in read_metrics(os.path.join(output_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def sft_run(workdir):
    """An uninterrupted SFT run, the reference the resume test compares against."""
    config = write_config(workdir, "sft_full", trainer={"max_steps": 12, "save_every": 3, "batch_size": 4,
                                                        "lr": 3.0e-3})
    rc, log = cli("sft", "--config", config)
    assert rc == 0, log[-3000:]
    return workdir / "sft_full", config


def test_sft_lowers_the_loss_and_exports_a_loadable_model(sft_run, workdir):
    from transformers import AutoModelForCausalLM

    out, _ = sft_run
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, 13))
    first, last = sum(losses(out)[:4]) / 4, sum(losses(out)[-4:]) / 4
    assert last < first - 0.3, (first, last)  # every 4 steps cover the 8 examples twice: comparable windows
    assert all(r["skipped_total"] == 0 for r in records)
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["trainer"]["max_steps"] == 12 and resolved["trainer"]["weight_decay"] == 0.0  # defaults filled

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    initial = AutoModelForCausalLM.from_pretrained(workdir / "model")
    assert set(model.state_dict()) == set(initial.state_dict())
    assert not torch.equal(model.lm_head.weight, initial.lm_head.weight)
    assert os.path.exists(out / "final" / "model.safetensors")


def test_sft_killed_and_resumed_reproduces_the_metrics(sft_run, workdir):
    reference, _ = sft_run
    config = write_config(workdir, "sft_killed", trainer={"max_steps": 12, "save_every": 3, "batch_size": 4,
                                                          "lr": 3.0e-3})
    out = workdir / "sft_killed"
    metrics = out / "metrics.jsonl"
    # Killed just after step 5's line: past the step-3 checkpoint, before step 6's.
    kill = os.path.join(ROOT, "tests", "helpers", "flaky_kill.py")
    rc, log = run_group([sys.executable, kill, "5", "sft", "--config", config], timeout=180, env=ENV)
    assert rc == -signal.SIGKILL, log[-3000:]
    assert [r["step"] for r in read_metrics(str(metrics))] == [1, 2, 3, 4, 5]
    assert os.path.exists(out / "checkpoints" / "step-3")
    assert not os.path.exists(out / "final")

    rc, log = cli("sft", "--config", config, "--resume")
    assert rc == 0, log[-3000:]
    want = read_metrics(os.path.join(reference, "metrics.jsonl"))
    got = read_metrics(metrics)
    assert [r["step"] for r in got] == list(range(1, 13))
    for a, b in zip(want, got, strict=True):
        assert {k: a.get(k) for k in DETERMINISTIC_KEYS} == {k: b.get(k) for k in DETERMINISTIC_KEYS}, a["step"]


def test_sft_resume_with_another_seed_is_refused_before_it_loads(sft_run, workdir):
    """The checkpoint holds the run's settings (fastrlhf.engine.checkpoint.run_identity); SFT's resume compared none,
    so a new seed resumed silently with the old one's data order in its sampler state."""
    reference, _ = sft_run
    out = workdir / "sft_reseeded"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("final"))
    config = write_config(workdir, "sft_reseeded", seed=7, trainer={"max_steps": 13, "save_every": 3,
                                                                   "batch_size": 4, "lr": 3.0e-3})
    rc, log = cli("sft", "--config", config, "--resume")
    assert rc == 2, log[-3000:]
    assert "was saved with seed = 0, this run has 7" in log, log[-3000:]


def _run_in_process(command, config_path):
    from fastrlhf.config import load_config

    config = load_config(config_path, command)
    if command == "sft":
        from fastrlhf.supervised.sft import run
    else:
        from fastrlhf.supervised.reward_model import run
    # These two for this run only: left in os.environ, they reached every later test's children (test order
    # mattered). Only they are put back: the rank variables the run's process group set stay, as the later
    # in-process engines here need them.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTRLHF_DIST_TIMEOUT", os.environ.get("FASTRLHF_DIST_TIMEOUT", "60"))
        patch.setenv("FASTRLHF_NO_PROGRESS", "1")
        return run(config), config


def test_pairwise_reward_model_separates_a_toy_set(workdir):
    from transformers import AutoModelForSequenceClassification

    config = write_config(workdir, "rm_pairwise", data={"path": str(workdir / "pairs.jsonl")},
                          trainer={"max_steps": 12, "lr": 1.0e-2})
    last, cfg = _run_in_process("rm", config)
    records = read_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"))
    assert sum(r["accuracy"] for r in records[-3:]) / 3 >= 0.9, records[-3:]
    assert records[-1]["loss"] < records[0]["loss"]
    model = AutoModelForSequenceClassification.from_pretrained(os.path.join(cfg.output_dir, "final"))
    assert model.config.num_labels == 1
    chosen = torch.tensor([[5, 6, 7, 8, 9]])
    rejected = torch.tensor([[50, 51, 52, 53, 54]])
    with torch.no_grad():
        assert model(chosen).logits[0, 0] > model(rejected).logits[0, 0]


def test_classifier_reward_model_separates_a_toy_set(workdir):
    config = write_config(workdir, "rm_cls", kind="classifier", data={"path": str(workdir / "cls.jsonl")},
                          trainer={"max_steps": 12, "lr": 1.0e-2}, deepspeed={"zero_stage": 1})
    last, cfg = _run_in_process("rm", config)
    records = read_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"))
    assert sum(r["accuracy"] for r in records[-3:]) / 3 >= 0.9, records[-3:]


def test_guard_inside_a_zero2_engine_skips_the_update(workdir):
    from fastrlhf import distributed as D
    from fastrlhf.config import DeepSpeedConfig
    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.modeling.tiny import make_tiny_llama

    D.init_distributed(timeout_s=60)
    guard = StepGuard(3)
    engine = build_train_engine(make_tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=1).train(),
                                  DeepSpeedConfig(zero_stage=2), lr=1e-2, max_grad_norm=1.0, guard=guard,
                                  warmup_steps=4)
    ids = torch.tensor([[3, 4, 5, 6]])
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    lr = engine.get_lr()[0]

    loss = engine(input_ids=ids, labels=ids).loss * float("nan")
    guard.note_loss(loss)
    engine.backward(loss)
    engine.step()
    assert guard.end_step() and guard.skipped_total == 1
    assert all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    assert engine.get_lr()[0] == lr  # the warm-up waits for an update that happened, as the weights do

    loss = engine(input_ids=ids, labels=ids).loss
    guard.note_loss(loss)
    engine.backward(loss)
    engine.step()
    assert not guard.end_step() and guard.skipped_in_row == 0
    assert not torch.equal(before["lm_head.weight"], engine.module.lm_head.weight)
    assert engine.get_lr()[0] == pytest.approx(2 * lr)  # warm-up factors 1/4, then 2/4
    assert "guard" not in engine.lr_scheduler.state_dict()


def test_two_ranks_under_the_deepspeed_launcher_zero3(workdir):
    from transformers import AutoModelForCausalLM

    config = write_config(workdir, "sft_2rank", trainer={"max_steps": 3, "save_every": 2},
                          deepspeed={"zero_stage": 3})
    port = free_port()
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    rc, log = run_group([launcher, "--num_gpus", "2", "--master_port", str(port), "--module", "fastrlhf", "sft",
                         "--config", config], timeout=240, env=ENV)
    assert rc == 0, log[-5000:]
    out = workdir / "sft_2rank"
    assert [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]
    assert sorted(os.listdir(out / "checkpoints" / "step-2")) == ["model", "rank-0.pt", "rank-1.pt"]
    model = AutoModelForCausalLM.from_pretrained(out / "final")  # ZeRO-3 shards gathered into a full model
    assert model.lm_head.weight.shape == (VOCAB, 64)

    # A kill during step 3 leaves this run as it was after the step-2 checkpoint; resuming it on 2
    # ranks must end where the uninterrupted run ended (step-3 metrics, final weights).
    resumed = workdir / "sft_2rank_resumed"
    shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("final", "step-3"))
    (resumed / "checkpoints" / "latest").write_text("step-2\n")
    config = write_config(workdir, "sft_2rank_resumed", trainer={"max_steps": 3, "save_every": 2},
                          deepspeed={"zero_stage": 3})
    rc, log = run_group([launcher, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "fastrlhf",
                         "sft", "--config", config, "--resume"], timeout=240, env=ENV)
    assert rc == 0, log[-5000:]
    want = read_metrics(os.path.join(out, "metrics.jsonl"))
    got = read_metrics(os.path.join(resumed, "metrics.jsonl"))
    assert [r["step"] for r in got] == [1, 2, 3]
    # Steps 1-2 are the copied records (a run that restarted from scratch would have re-timed them).
    assert [r["step_time_s"] for r in got[:2]] == [r["step_time_s"] for r in want[:2]]
    for a, b in zip(want, got, strict=True):
        assert {k: a.get(k) for k in DETERMINISTIC_KEYS} == {k: b.get(k) for k in DETERMINISTIC_KEYS}, a["step"]
    again = AutoModelForCausalLM.from_pretrained(resumed / "final")
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_sft_with_lora_exports_merged_weights(workdir):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = write_config(workdir, "sft_lora", model={"lora_r": 4, "lora_alpha": 8},
                          trainer={"max_steps": 3, "lr": 5.0e-2}, deepspeed={"zero_stage": 0})
    _run_in_process("sft", config)
    final = workdir / "sft_lora" / "final"
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert not any("lora" in key for key in f.keys())
    model = AutoModelForCausalLM.from_pretrained(final)
    initial = AutoModelForCausalLM.from_pretrained(workdir / "model")
    q_new = model.model.layers[0].self_attn.q_proj.weight
    q_old = initial.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_new, q_old)  # the adapter was merged into the targeted projections
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, initial.model.layers[0].mlp.up_proj.weight)


def test_too_many_skipped_steps_stop_sft_with_a_checkpoint(workdir, capsys):
    from fastrlhf import cli

    # An absurd learning rate: the first update blows the weights up, later losses are not finite.
    config = write_config(workdir, "sft_diverge", trainer={"max_steps": 8, "lr": 1.0e30, "max_grad_norm": 1.0e30,
                                                           "max_skipped_steps": 2})
    assert cli.main(["sft", "--config", config]) == 1
    err = capsys.readouterr().err
    assert "steps in a row had a non-finite loss or gradient" in err and "a checkpoint was saved" in err
    records = read_metrics(os.path.join(workdir / "sft_diverge", "metrics.jsonl"))
    assert records[-1]["skipped"] == 1 and records[-2]["skipped"] == 1 and records[-1]["skipped_total"] >= 2
    latest = (workdir / "sft_diverge" / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{records[-1]['step']}"
    assert not os.path.exists(workdir / "sft_diverge" / "final")


def test_value_model_export_roundtrip_and_frozen_engines(workdir):
    from fastrlhf import distributed as D
    from fastrlhf.config import DeepSpeedConfig, ModelConfig
    from fastrlhf.modeling import export_hf, load_causal_lm, load_value_model

    D.init_distributed(timeout_s=60)
    model_cfg = ModelConfig(path=str(workdir / "model"))
    ids = torch.tensor([[3, 4, 5, 6, 7]])

    critic = build_train_engine(load_value_model(model_cfg), DeepSpeedConfig(zero_stage=2), lr=1e-2)
    values = critic(ids)
    assert values.shape == (1, 5) and values.dtype == torch.float32
    critic.backward(((values - 1.0) ** 2).mean())
    critic.step()
    export_hf(critic, str(workdir / "critic_export"), zero_stage=2)
    assert (workdir / "critic_export" / "value_head.safetensors").exists()
    reloaded = load_value_model(model_cfg, path=str(workdir / "critic_export"), trainable=False)
    with torch.no_grad():
        assert torch.allclose(reloaded(ids), critic.module(ids), atol=1e-6)
    assert not any(p.requires_grad for p in reloaded.parameters())

    plain = load_causal_lm(model_cfg, trainable=False)
    with torch.no_grad():
        want = plain(ids).logits
    for actor_stage in (2, 3):  # stage 0 replica beside a ZeRO-1/2 actor, ZeRO-3 inference beside a ZeRO-3 one
        frozen = build_frozen_engine(load_causal_lm(model_cfg, trainable=False), DeepSpeedConfig(zero_stage=2),
                                       actor_zero_stage=actor_stage)
        assert frozen.zero_optimization_stage() == (3 if actor_stage == 3 else 0)
        with torch.no_grad():
            assert torch.allclose(frozen(ids).logits, want, atol=1e-5)


def test_fused_sft_loss_matches_the_plain_cross_entropy(workdir):
    from fastrlhf import distributed as D
    from fastrlhf.config import DeepSpeedConfig
    from fastrlhf.data import SFTExample
    from fastrlhf.modeling.tiny import make_tiny_llama
    from fastrlhf.supervised.sft import collate_sft, sft_loss

    D.init_distributed(timeout_s=60)
    engine = build_train_engine(make_tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=1).train(),
                                  DeepSpeedConfig(zero_stage=0), lr=1e-3)
    batch = collate_sft([SFTExample([3, 4, 5], [6, 7]), SFTExample([8], [9, 10, 11, 12])], pad_id=2)
    fused = sft_loss(engine, batch, use_fused=True, chunk_size=3)
    plain = sft_loss(engine, batch, use_fused=False)
    assert torch.allclose(fused, plain, atol=1e-5), (fused, plain)
    # The mask covers response tokens only: 2 + 4 of them, none of the prompt's.
    assert batch["loss_mask"].sum() == 6 and batch["loss_mask"][0, :3].sum() == 0
    fused.backward()
    assert engine.module.lm_head.weight.grad is not None


def test_zero3_loading_partitions_at_load_time(workdir):
    import deepspeed

    from fastrlhf import distributed as D
    from fastrlhf.config import DeepSpeedConfig, ModelConfig
    from fastrlhf.modeling import load_causal_lm, load_sequence_classifier, load_value_model

    D.init_distributed(timeout_s=60)
    model_cfg = ModelConfig(path=str(workdir / "model"))
    stage3 = deepspeed_config(DeepSpeedConfig(zero_stage=3), micro_batch_size=1)
    model = load_causal_lm(model_cfg, zero3_config=stage3)
    plain = load_causal_lm(model_cfg)  # outside the context: an ordinary model again
    assert hasattr(model.lm_head.weight, "ds_id") and not hasattr(plain.lm_head.weight, "ds_id")
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        assert torch.equal(model.lm_head.weight, plain.lm_head.weight)
    classifier = load_sequence_classifier(model_cfg, 2, zero3_config=stage3)
    with deepspeed.zero.GatheredParameters([classifier.score.weight]):
        assert 0.005 < classifier.score.weight.std().item() < 0.05  # HF init, not zero.Init's std ~1
    critic = load_value_model(model_cfg, zero3_config=stage3)  # the PPO critic: no full replica per rank first
    assert hasattr(critic.lm.lm_head.weight, "ds_id") and not hasattr(critic.v_head.weight, "ds_id")


def test_zero3_export_gathers_in_buckets_and_saves_the_full_model(workdir, monkeypatch):
    import deepspeed
    from safetensors.torch import load_file

    from fastrlhf import distributed as D
    from fastrlhf.config import DeepSpeedConfig, ModelConfig
    from fastrlhf.modeling import export_hf, load_causal_lm

    D.init_distributed(timeout_s=60)
    model_cfg = ModelConfig(path=str(workdir / "model"))
    stage3 = deepspeed_config(DeepSpeedConfig(zero_stage=3), micro_batch_size=1)
    engine = build_train_engine(load_causal_lm(model_cfg, zero3_config=stage3), DeepSpeedConfig(zero_stage=3),
                                  lr=1e-2)
    params = list(engine.module.parameters())
    largest = max(p.ds_numel for p in params) * 4
    gathers = []
    real = deepspeed.zero.GatheredParameters

    def spy(params_to_gather, *args, **kwargs):
        gathers.append(len(list(params_to_gather)))
        return real(params_to_gather, *args, **kwargs)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", spy)
    export_hf(engine, str(workdir / "zero3_export"), zero_stage=3, bucket_bytes=largest)
    monkeypatch.undo()
    assert len(gathers) > 2 and max(gathers) < len(params)  # never the whole model at once
    saved = load_file(str(workdir / "zero3_export" / "model.safetensors"))
    plain = load_causal_lm(model_cfg)
    want = plain.state_dict()
    assert set(want) - set(saved) <= {"lm_head.weight"}  # a tied head is saved once
    for name, tensor in saved.items():
        assert torch.equal(tensor, want[name]), name



@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_saves_the_model_own_weights_without_building_a_second_model(tmp_path, monkeypatch, tied):
    from transformers import LlamaForCausalLM

    from fastrlhf.modeling import export_hf
    from fastrlhf.modeling.tiny import make_tiny_llama

    model = make_tiny_llama(seed=3, tie_word_embeddings=tied)
    built = []
    real_init = LlamaForCausalLM.__init__

    def counting_init(self, *args, **kwargs):
        built.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "__init__", counting_init)
    export_hf(model, str(tmp_path / "export"), zero_stage=0)
    assert built == []  # the export held one model in memory, not two
    monkeypatch.undo()
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "export")
    assert reloaded.config.tie_word_embeddings == tied
    want = model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_rank_examples_deals_by_real_tokens_unless_switched_off():
    from fastrlhf.data import SFTExample
    from fastrlhf.supervised import SupervisedJob, rank_examples
    from fastrlhf.supervised.sft import sft_token_parts

    examples = [SFTExample(prompt_ids=[1] * p, response_ids=[2] * r) for p, r in [(200, 90), (10, 270), (5, 5), (8, 9)]]
    job = SupervisedJob(examples, torch.nn.Linear(1, 1), loss_fn=None, token_parts=sft_token_parts)
    dealt = [rank_examples(job, [0, 1, 2, 3], True, r, 2) for r in range(2)]
    assert dealt == [[examples[0], examples[2]], [examples[1], examples[3]]]  # 300 and 297 tokens
    assert rank_examples(job, [0, 1, 2, 3], False, 0, 2) == examples[:2]  # 570 against 27
    without_counts = SupervisedJob(examples, torch.nn.Linear(1, 1), loss_fn=None)
    assert rank_examples(without_counts, [0, 1, 2, 3], True, 0, 2) == examples[:2]
