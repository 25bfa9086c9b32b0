"""A reward function for the kill-and-resume test: first completion token odd -> 1.0 (a signal a
random model has from step 1), and a SIGKILL of its own process once it has been called more than
``FASTRLHF_TEST_KILL_AFTER_CALLS`` times (a kill at a known point, mid-step, after a checkpoint)."""

import os
import signal

_calls = 0


def reward(prompt_ids, completion_ids, meta):
    global _calls
    _calls += 1
    kill_after = int(os.environ.get("FASTRLHF_TEST_KILL_AFTER_CALLS", "0"))
    if kill_after and _calls > kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
    return float(bool(completion_ids) and completion_ids[0] % 2 == 1)
