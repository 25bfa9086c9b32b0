"""A newcomer's path, from a clean copy of the checkout, with the commands the README and docs/config.md give:
make the tiny chat model, train GRPO for 2 steps on `messages` rows with a reward written for TRL
(``reward(prompts, completions, answer, **kwargs)``), and load the exported ``final/`` with
``AutoModelForCausalLM``."""

import json
import os
import textwrap

import pytest
from helpers.clone import bare_clone, clone_env
from helpers.launch import run_group

# 8 rows in TRL's conversational format, with the column the reward reads.
ROWS = [{"messages": [{"role": "system", "content": "Answer with a number."},
                      {"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a, b in [(2, 3), (7, 5), (4, 4), (9, 1), (6, 2), (3, 8), (5, 5), (1, 7)]]

REWARD = '''
import re


def correct_answer(prompts, completions, answer, **kwargs):
    """1.0 where the completion's last number is the row's answer (TRL's GRPOTrainer calls it the same way)."""
    assert isinstance(prompts[0], list) and completions[0][0]["role"] == "assistant"
    scores = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\\d+", completion[0]["content"])
        scores.append(float(bool(numbers) and numbers[-1] == str(expected)))
    return scores
'''

CONFIG = """
algorithm: grpo
output_dir: runs/my-grpo
model: {path: runs/tiny-chat}
reward:
  functions:
    - {function: "my_rewards:correct_answer", weight: 1.0}
data: {prompts: rows.jsonl, max_prompt_len: 64}
rollout: {n: 4, max_new_tokens: 8}
trainer: {max_steps: 2, prompts_per_step: 4, minibatch_size: 16}
"""

LOAD = """
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("runs/my-grpo/final")
tokenizer = AutoTokenizer.from_pretrained("runs/my-grpo/final")
ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=4, do_sample=False)
print("loaded", type(model).__name__, out.shape[1] - ids["input_ids"].shape[1], "new tokens")
"""


@pytest.mark.slow
def test_a_newcomers_path_from_a_clean_copy(tmp_path):
    clone = bare_clone(tmp_path / "fastrlhf")
    env = clone_env(clone)
    assert not os.path.exists(os.path.join(clone, "runs"))

    def run(*argv, timeout):
        code, out = run_group(list(argv), timeout=timeout, env=env, cwd=clone)
        assert code == 0, f"{' '.join(argv)} exited {code}:\n{out[-4000:]}"
        return out

    # 1. The model: one command (README's Config section).
    run(".venv/bin/python", "-m", "fastrlhf.modeling.tiny_chat", "runs/tiny-chat", timeout=300)

    # 2. One's own task: messages rows with an answer column, a TRL reward beside them, a config.
    with open(os.path.join(clone, "rows.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in ROWS)
    with open(os.path.join(clone, "my_rewards.py"), "w") as f:
        f.write(REWARD)
    with open(os.path.join(clone, "grpo.yaml"), "w") as f:
        f.write(textwrap.dedent(CONFIG))

    # 3. GRPO, 2 steps; the run exports final/ after its last step.
    run(".venv/bin/fastrlhf", "train", "--config", "grpo.yaml", timeout=480)
    metrics = [json.loads(line) for line in open(os.path.join(clone, "runs/my-grpo/metrics.jsonl"))]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0.0 <= m["reward/correct_answer"] <= 1.0 and m["generated_tokens"] > 0 for m in metrics)

    # 4. The export, loaded as any Hugging Face chat model.
    out = run(".venv/bin/python", "-c", LOAD, timeout=180)
    assert "loaded Qwen2ForCausalLM" in out, out
