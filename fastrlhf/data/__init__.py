"""Training data: JSONL (or JSON array) files, Parquet files or ``datasets`` folders -> validated token-id examples.

Every bad line is found before training starts and reported together, with its line number
(``data error: prompts.jsonl:17: empty prompt``). Sampling is a seeded, resumable epoch shuffle so
that a resumed run sees exactly the batches an uninterrupted run would have seen.

A prompt is token ids (``prompt_ids``), text (``prompt``) or a chat (``messages``: a list of
``{"role", "content"}`` objects), which the tokenizer's chat template turns into ids with the generation
prompt (``data.chat_template``: auto | true | false, see :func:`load_prompts`). The prompt as the row
gives it (text or messages) travels beside its columns (:class:`Columns`), for rewards in TRL's format.

Three modules, re-exported here: ``reading`` (files -> rows, bad lines reported together),
``examples`` (rows -> prompts, SFT examples, pairs, labelled sequences) and ``sampling`` (the epoch
shuffle and the deal to the ranks).
"""

from fastrlhf.data.examples import *  # noqa: F403
from fastrlhf.data.examples import __all__ as _examples
from fastrlhf.data.reading import *  # noqa: F403
from fastrlhf.data.reading import __all__ as _reading
from fastrlhf.data.sampling import *  # noqa: F403
from fastrlhf.data.sampling import __all__ as _sampling

__all__ = [*_reading, *_examples, *_sampling]
