"""Where the RL step reads a decoder reward model's score (``fastrlhf.rl.forward.reward_model_scores``): where the
model was trained.

The peers' facts (github:huggingface/trl at f2cd577, the installed transformers 5.x):

* transformers ``transformers/modeling_layers.py`` ``GenericForSequenceClassification.forward`` (Llama, Qwen2, ...):
  ``non_pad_mask = (input_ids != config.pad_token_id)``, ``last_non_pad_token = (token_indices *
  non_pad_mask).argmax(-1)``: the score of the rightmost token whose id is not the pad id (position 0 where all are).
* TRL ``trl/trainer/reward_trainer.py``: ``pad_token = args.pad_token or processing_class.pad_token or
  processing_class.eos_token`` and ``model.config.pad_token_id = processing_class.pad_token_id`` (so pad == eos for a
  tokenizer without a pad token, as Llama 3's); ``add_eos`` appends the eos to text ``chosen``/``rejected`` (a chat's
  template closes the assistant turn itself); ``DataCollatorForPreference`` pads on the right with the pad id;
  ``compute_loss`` trains ``model(**inputs).logits``: transformers' pooling, so with pad == eos the token BEFORE the
  closing eos.
* TRL ``trl/trainer/grpo_trainer.py``: completions are ``batch_decode(completion_ids, skip_special_tokens=True)``
  (no eos); ``_calculate_rewards`` tokenizes ``prompt + completion`` with ``add_special_tokens=False``,
  ``padding_side="right"``, and scores ``reward_func(**reward_inputs).logits[:, 0]``: transformers' pooling again.

So a TRL folder (no ``fastrlhf_score_position`` in its config.json) is read where transformers pools, among the
attended tokens, padded and packed. ``fastrlhf rm`` trains at the last token, the closing eos included
(``fastrlhf.supervised.reward_model.scores``, pinned by tests/supervised/test_rm_scores.py) and marks its export: the RL
step reads such a folder there.
"""

import pytest
import torch
from helpers.hf_architectures import architecture_config
from helpers.other_device import OtherDevice
from helpers.peer_reward_models import config_json, save_trl_reward_model

from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.forward import SCORE_POSITION, reward_model_scores
from fastrlhf.rollout import Completion

EOS = 1  # the tiny architectures' eos (helpers.hf_architectures.SHAPE), here the pad id too, as TRL sets it
PROMPTS = [[5, 6, 7], [8, EOS, 9], [10, 11, 12, 13], [14, 15], [16, 17, 18]]
COMPLETIONS = [
    [20, 21, EOS],  # ended with its eos
    [22, 23, 24, 25],  # cut at max_new_tokens: no eos (after a prompt holding one, as a multi-turn chat does)
    [EOS],  # an immediate eos: the score falls back into the prompt
    [26, 27, 28, EOS],
    [29, 30],
]
ENDS_WITH_EOS = [c[-1] == EOS for c in COMPLETIONS]


def _experience(pad_id: int = EOS, device="cpu"):
    """The RL step's batch: prompts left-padded, completions right-padded."""
    return build_experience(PROMPTS, [[Completion(c, [0.0] * len(c), "stop" if c[-1] == EOS else "length")]
                                      for c in COMPLETIONS], pad_id, device)


def _classifier(folder, packed: bool = False):
    """The folder loaded as the RL trainer loads a classifier reward model (fastrlhf.rl.trainer._reward_model)."""
    from transformers import AutoModelForSequenceClassification

    from fastrlhf.modeling import use_attention

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    use_attention(model, packed, backend="sdpa")
    return model.requires_grad_(False)


def transformers_scores(folder, rows: list[list[int]]) -> torch.Tensor:
    """transformers' own forward on right-padded rows (padded with the pad id, as TRL's collators pad):
    ``logits[:, 0]``, pooled at the last id that is not ``config.pad_token_id``."""
    model = _classifier(folder)
    pad = model.config.pad_token_id
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0]


def last_token_scores(folder, rows: list[list[int]]) -> torch.Tensor:
    """The score at each row's very last token (its eos where it ends with one), each row alone."""
    model = _classifier(folder)
    with torch.no_grad():
        return torch.stack([model.score(model.model(input_ids=torch.tensor([r])).last_hidden_state[0, -1])[0]
                            for r in rows])


@pytest.fixture(scope="module")
def trl_folder(tmp_path_factory):
    folder = save_trl_reward_model(tmp_path_factory.mktemp("trl") / "rm", architecture_config("llama"),
                                   pad_token_id=EOS)
    assert config_json(folder)["pad_token_id"] == config_json(folder)["eos_token_id"] == EOS
    assert SCORE_POSITION not in config_json(folder)
    return folder


ROWS = [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_trl_reward_model_with_pad_eos_scores_where_transformers_pools_it(trl_folder, packed):
    expected = transformers_scores(trl_folder, ROWS)
    at_eos = torch.tensor(ENDS_WITH_EOS)
    # the test tells the two readings apart: the old one (the last attended token) scored the eos rows elsewhere
    old = last_token_scores(trl_folder, ROWS)
    assert (old - expected)[at_eos].abs().min() > 1e-2
    torch.testing.assert_close(old[~at_eos], expected[~at_eos], rtol=1e-4, atol=1e-4)

    got = reward_model_scores(_classifier(trl_folder, packed), _experience(), micro_batch=2, packed=packed)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_the_batch_padding_id_does_not_matter_only_the_attended_tokens(trl_folder):
    """The policy pads its batch with its own pad id (here 0, not the reward model's): the read is among the
    attended tokens, never at a padding column."""
    got = reward_model_scores(_classifier(trl_folder), _experience(pad_id=0))
    torch.testing.assert_close(got, transformers_scores(trl_folder, ROWS), rtol=1e-4, atol=1e-4)


def test_a_trl_reward_model_scores_as_trl_grpo_reads_the_completion_text(trl_folder):
    """TRL GRPO scores ``prompt + completion`` text, the completion decoded with ``skip_special_tokens=True`` (its eos
    dropped) and re-tokenized with ``add_special_tokens=False``: for these ids, the rows without their closing eos.
    The score there is the same token's (a decoder's hidden state sees only the tokens before it)."""
    grpo_rows = [p + [t for t in c if t != EOS] for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    expected = transformers_scores(trl_folder, grpo_rows)
    got = reward_model_scores(_classifier(trl_folder), _experience())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_trl_reading_makes_no_device_read(trl_folder, packed):
    """Positions come from the device's ids and mask by device ops: no ``.item()``, no ``nonzero``, no blocking copy
    (the CPU emulation of a second device, helpers.other_device)."""
    model = _classifier(trl_folder, packed)
    expected = transformers_scores(trl_folder, ROWS)
    with OtherDevice() as dev:
        model, exp = dev.move(model), _experience(device=dev.device)
        before = len(dev.reads)  # moving the weights and the batch is the test's, not the scoring's
        got = reward_model_scores(model, exp, packed=packed)
        assert dev.reads[before:] == []
        got = got.data_.clone()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def fastrlhf_folder(tmp_path_factory, trl_folder):
    """The TRL folder after ``fastrlhf rm``'s job is built on it: saved as its export is (save_pretrained of the
    trained model, whose config build_job marked)."""
    from fastrlhf.config import ModelConfig, RMConfig, RMDataConfig, SFTTrainerConfig
    from fastrlhf.data import PairExample
    from fastrlhf.supervised import reward_model

    model = _classifier(trl_folder)
    config = RMConfig(output_dir="u", model=ModelConfig(path="u", attention="sdpa"), data=RMDataConfig(path="u"),
                      trainer=SFTTrainerConfig(max_steps=1, batch_size=2))
    reward_model.build_job(config, model, [PairExample([5, 6], [7, EOS], [8, EOS], 0.0)] * 2)
    folder = tmp_path_factory.mktemp("fastrlhf") / "final"
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_fastrlhf_reward_model_scores_where_fastrlhf_rm_trained_it(fastrlhf_folder, trl_folder, packed):
    """Same weights, same pad == eos, but the mark: the RL step reads the closing eos, as ``scores`` trains."""
    from fastrlhf.supervised.reward_model import scores

    assert config_json(fastrlhf_folder)[SCORE_POSITION] == "last_token"
    with torch.no_grad():
        trained = scores(_classifier(fastrlhf_folder), ROWS, EOS)[:, 0]
    torch.testing.assert_close(trained, last_token_scores(fastrlhf_folder, ROWS), rtol=1e-4, atol=1e-4)
    got = reward_model_scores(_classifier(fastrlhf_folder, packed), _experience(), micro_batch=2, packed=packed)
    torch.testing.assert_close(got, trained, rtol=1e-4, atol=1e-4)
    # ... where the unmarked TRL folder with the same weights is read a token earlier on the eos rows
    trl = reward_model_scores(_classifier(trl_folder, packed), _experience(), micro_batch=2, packed=packed)
    at_eos = torch.tensor(ENDS_WITH_EOS)
    assert (trl - got)[at_eos].abs().min() > 1e-2
    torch.testing.assert_close(trl[~at_eos], got[~at_eos], rtol=1e-4, atol=1e-4)
