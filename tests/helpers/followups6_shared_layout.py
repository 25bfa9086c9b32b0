"""The shared-prompt packed layout as ``PackedLayout._build_shared`` built it token by token (a Python loop over
every token), kept for tests/rl/test_followups_audit6.py to check the vectorised build against: its fields as a dict."""

import torch


def old_build_shared(prompt_lens, completion_lens, T, prompt_width, groups) -> dict:
    """Each group's prompt once, then its members' completions, each positioned as if it followed the
    prompt alone (positions p..p+n-1). Every completion attends to its prompt and causally to itself
    (``segments``), so each token sees exactly what it sees in its own sequence; the prompt's hidden
    states are computed once and their gradient is the sum over the group, as with separate copies."""
    if len(groups) != len(prompt_lens):
        raise ValueError(f"need one prompt group per sequence, got {len(groups)} for {len(prompt_lens)}")
    members: dict[int, list[int]] = {}
    for b, g in enumerate(groups):
        members.setdefault(g, []).append(b)
    width = None if prompt_width is None else int(prompt_width) + T
    positions, source, hidden, token, segments = [], [], [], [], []
    last = [0] * len(prompt_lens)
    for rows in members.values():
        p = prompt_lens[rows[0]]
        if any(prompt_lens[b] != p for b in rows):
            lengths = sorted({prompt_lens[b] for b in rows})
            raise ValueError(
                f"sequences of one prompt group have prompts of {lengths} "
                "tokens: a shared prompt must be the same prompt"
            )
        start = len(positions)
        positions += range(p)
        if width is not None:
            first = rows[0] * width + int(prompt_width) - p
            source += range(first, first + p)
        segments.append((start, start + p, start, start))
        for b in rows:
            n, at = completion_lens[b], len(positions)
            positions += range(p, p + n)
            if width is not None:
                first = b * width + int(prompt_width)
                source += range(first, first + n)
            hidden += [start + p - 1] + list(range(at, at + n - 1)) if n else []
            token += range(b * T, b * T + n)
            last[b] = at + n - 1 if n else start + p - 1
            if n:
                segments.append((at, at + n, start, start + p))

    def long(values):
        return torch.tensor(values, dtype=torch.long)

    return dict(
        position_ids=long(positions).view(1, -1),
        hidden_index=long(hidden),
        token_index=long(token),
        last_index=long(last),
        source_index=None if width is None else long(source),
        segments=segments,
    )
