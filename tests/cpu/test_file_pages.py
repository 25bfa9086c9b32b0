"""fastrlhf.cpu.file_pages: a frozen model's file-backed weights leave the RSS after use, unchanged.

The danger is in what must never happen: DONTNEED on anonymous memory zeroes it, and on a
copy-on-write page it brings the file's bytes back. So besides the release itself (the pages leave
the process, the next forward gives bitwise the same logits), anonymous weights and a mapping with a
written page must be left alone with their values.
"""

import mmap
import sys

import pytest
import torch

from fastrlhf.config import ModelConfig
from fastrlhf.cpu.file_pages import FilePages, file_page_ranges
from fastrlhf.modeling import load_causal_lm
from fastrlhf.modeling.tiny import make_tiny_qwen2, save_tiny_qwen2

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")

KW = dict(vocab_size=4096, hidden_size=128, num_heads=4, num_kv_heads=2, initializer_range=0.2)
IDS = torch.tensor([[5, 17, 300, 4000, 9, 9, 2]])


FROZEN_FP32 = ModelConfig(path="unused", dtype="float32")  # the settings of a frozen fp32 copy (path given apart)


def _frozen(path):
    model = load_causal_lm(FROZEN_FP32, str(path), trainable=False)
    with torch.no_grad():
        logits = model(IDS).logits
    return model, logits


def _resident_bytes(ranges) -> int:
    """Bytes of ``ranges`` resident in this process now (mincore-free: /proc/self/smaps Rss of their
    mappings, which hold nothing else of size in these tests)."""
    wanted = {(m[0], m[1]) for _, _, m in ranges}
    total, current = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                current = tuple(int(x, 16) for x in head[0].split("-")) in wanted
            elif current and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def test_a_loaded_reference_leaves_the_rss_and_computes_the_same(tmp_path):
    model, logits = _frozen(save_tiny_qwen2(tmp_path / "m", seed=1, **KW) and tmp_path / "m")
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    pages = FilePages(model, min_bytes=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # every weight is in the file mapping: all of it but the pages shared with a neighbour
    assert weight_bytes - len(params) * 2 * mmap.PAGESIZE <= pages.nbytes <= weight_bytes
    resident = _resident_bytes(pages.ranges)
    assert resident >= pages.nbytes  # the forward touched them all

    assert pages.release() == pages.nbytes
    assert _resident_bytes(pages.ranges) <= resident - pages.nbytes
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, logits)
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), name
    assert _resident_bytes(pages.ranges) >= pages.nbytes  # back, from the page cache
    assert pages.release() == pages.nbytes  # and again at the next step


def test_anonymous_weights_are_not_touched():
    model = make_tiny_qwen2(seed=1, **KW).eval()
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    pages = FilePages(model, min_bytes=0)
    assert pages.ranges == [] and pages.release() == 0
    assert file_page_ranges([torch.randn(1 << 20)]) == []
    for name, p in model.named_parameters():
        assert torch.equal(p, kept[name]), name


def test_a_mapping_with_a_written_page_is_left_alone(tmp_path):
    save_tiny_qwen2(tmp_path / "m", seed=1, **KW)
    model, _ = _frozen(tmp_path / "m")
    pages = FilePages(model, min_bytes=0)
    assert pages.nbytes > 0
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        embed[0].add_(1.0)  # copy-on-write: this page is the process's own now, not the file's
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert pages.release() == 0
    for name, p in model.named_parameters():
        assert torch.equal(p, kept[name]), name


def test_the_rl_step_releases_the_reference_after_its_pass(tmp_path, monkeypatch):
    """After each reference pass, and only for a plain frozen reference (a LoRA actor's disabled
    adapter is the actor itself)."""
    from helpers.rl_case import GRPO, PAD, PROMPTS, SCORES, FixedScorer, fixed_completions, make_config, tiny_actor

    from fastrlhf.cpu import file_pages
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rl.step import RLStep

    monkeypatch.setattr(file_pages, "MIN_RELEASE_BYTES", 0)  # the tiny reference counts here
    released = []
    real = file_pages.FilePages.release
    monkeypatch.setattr(file_pages.FilePages, "release", lambda self: released.append(real(self)) or released[-1])
    actor = tiny_actor()
    tiny_actor().save_pretrained(tmp_path / "ref")
    reference = load_causal_lm(FROZEN_FP32, str(tmp_path / "ref"), trainable=False)
    hp = make_config(GRPO)
    rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=reference,
                actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-3), pad_token_id=PAD,
                rollout_shares_actor=True)
    completions = fixed_completions(actor, hp.rollout.temperature)
    for _ in range(2):
        exp = build_experience(PROMPTS, completions, PAD)
        exp.scores = SCORES.clone()
        rl.logprobs_and_values(exp)
    assert len(released) == 2 and released[0] == released[1] == rl._reference_pages.nbytes > 0

    rl.reference = None  # as for a LoRA actor: its reference is the actor with the adapter disabled
    assert rl.release_reference_pages() == 0 and len(released) == 2


def test_a_reference_under_the_floor_is_never_scanned_again(tmp_path, monkeypatch):
    """Releasing reads /proc/self/smaps (15-30 ms in a trainer): not worth it for a small reference."""
    from fastrlhf.cpu import file_pages

    model, _ = _frozen(save_tiny_qwen2(tmp_path / "m", seed=1, **KW) and tmp_path / "m")
    whole = FilePages(model, min_bytes=0).nbytes
    assert 0 < whole < file_pages.MIN_RELEASE_BYTES
    monkeypatch.setattr(file_pages, "_clean_mappings", lambda wanted: pytest.fail("read smaps"))
    pages = FilePages(model)
    assert pages.ranges == [] and pages.release() == 0
    assert FilePages(model, min_bytes=whole).ranges  # at the floor it is released
