"""Long-context tasks generated offline for any tokenizer, target length and seed.

RULER-style retrieval and aggregation (needles in the bundled essays or in repeated noise, several
keys / values / queries, variable tracking, common and frequent words), a passkey task, and
long-text perplexity on the held-out essays.  Prompts are assembled from token ids, so the length is
exact (cwe / fwe: within one list item) and every needle's token span is known:

    input ids = head + context (haystack with needles inserted) + tail

`length` is the whole budget: prompt tokens + `max_new_tokens` (RULER's convention), so
`length <= max_position_embeddings` is all a model needs.  A needle asked for at depth d starts at
haystack token round(d * haystack_length) (d = the share of haystack tokens before it, RULER's depth),
moved to the nearest sentence start within 0.5% of the haystack; `Example.meta["needles"]` holds
(start, end, depth asked) of each needle in input ids.
"""

from __future__ import annotations

import random
import re
import string
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import ConfigError

NOISE = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass
class Example:
    """One prompt.  input_ids: prompt token ids (len = length - max_new_tokens; perplexity: the
    whole scored sequence); references: what the answer must contain; metric: a name from
    `metrics.score_prediction` or "perplexity"."""

    task: str
    length: int
    index: int
    input_ids: list[int]
    references: list[str]
    metric: str
    max_new_tokens: int
    meta: dict = field(default_factory=dict)
    all_classes: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.task}/{self.length}/{self.index}"


def example_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    """A generator that depends only on (seed, task, length, index), in every process."""
    return random.Random(f"{seed}/{task}/{length}/{index}")


# ----------------------------------------------------------------------------------------------
# text sources, tokenised once per codec
# ----------------------------------------------------------------------------------------------


class CodecCache:
    """Values computed once per (codec, key), held only while the codec lives.

    Keyed by the codec object through a weak reference, never by `id(codec)`: an id is reused
    once its object is garbage collected, and would hand a new tokenizer another one's token ids.
    A codec that cannot be weakly referenced is simply not cached.
    """

    def __init__(self) -> None:
        self._by_codec: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, codec, key, compute: Callable[[], object]):
        try:
            entries = self._by_codec.setdefault(codec, {})
        except TypeError:  # not weakly referenceable (or unhashable): compute every time
            return compute()
        if key not in entries:
            entries[key] = compute()
        return entries[key]

    def clear(self) -> None:
        self._by_codec.clear()


_UNIT_CACHE = CodecCache()


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, each with a leading space (so concatenated ids read as the text)."""
    return [" " + s.strip() for s in _SENTENCE_END.split(" ".join(text.split())) if s.strip()]


def _units(codec, name, texts: Callable[[], list[str]]) -> list[list[int]]:
    def compute() -> list[list[int]]:
        sentences = [s for text in texts() for s in split_sentences(text)]
        return [ids for ids in codec.encode_batch(sentences) if ids]

    return _UNIT_CACHE.get(codec, name, compute)


def essay_units(codec, essays: Sequence[str] | None = None) -> list[list[int]]:
    """The bundled training-split essays (or `essays`) as token ids per sentence."""
    if essays is not None:
        return _units(codec, ("essays", tuple(essays)), lambda: list(essays))
    from ..bundled import bundled_texts

    return _units(codec, "bundled-train", lambda: bundled_texts("train"))


def noise_units(codec) -> list[list[int]]:
    return _units(codec, "noise", lambda: [NOISE])


def word_list(essays: Sequence[str] | None = None) -> list[str]:
    """Distinct lower-case alphabetic words of 4-10 letters from the essays, sorted."""
    if essays is None:
        from ..bundled import bundled_texts

        essays = bundled_texts("train")
    words = {w for text in essays for w in re.findall(r"[a-z]+", text.lower()) if 4 <= len(w) <= 10}
    return sorted(words)


# ----------------------------------------------------------------------------------------------
# assembly
# ----------------------------------------------------------------------------------------------


def haystack(units: list[list[int]], count: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """`count` ids of consecutive units from a random start (wrapping); returns (ids, unit starts)."""
    if count <= 0:
        return [], [0]
    ids, starts = [], []
    position = rng.randrange(len(units))
    while len(ids) < count:
        starts.append(len(ids))
        ids.extend(units[position % len(units)])
        position += 1
    return ids[:count], starts


def assemble(
    codec,
    task: str,
    length: int,
    head: str,
    tail: str,
    units: list[list[int]],
    needles: Sequence[tuple[float, str]],
    max_new_tokens: int,
    rng: random.Random,
) -> tuple[list[int], dict]:
    """Prompt ids of exactly `length - max_new_tokens` tokens with each (depth, text) needle
    inserted at its depth of the context.  Returns (ids, meta with "needles": [(start, end, depth)]
    in input ids, "context": (start, end))."""
    head_ids, tail_ids = codec.encode(head), codec.encode(tail)
    needle_ids = [codec.encode(" " + text.strip()) for _, text in needles]
    prompt = length - max_new_tokens
    budget = prompt - len(head_ids) - len(tail_ids) - sum(map(len, needle_ids))
    if budget < 1:
        needed = length - budget + 1
        raise ConfigError(f"task {task!r}: length {length} is too short; it needs at least {needed} tokens")
    filler, starts = haystack(units, budget, rng)
    snap = max(1, budget // 200)
    order = sorted(range(len(needles)), key=lambda i: needles[i][0])
    placed, lowest = {}, 0
    for i in order:
        depth = needles[i][0]
        if not 0.0 <= depth <= 1.0:
            raise ConfigError(f"needle depth {depth} must lie in [0, 1]")
        target = max(round(depth * budget), lowest)
        near = [s for s in starts + [budget] if abs(s - target) <= snap and s >= lowest]
        where = min(near, key=lambda s: (abs(s - target), s)) if near else target
        placed[i], lowest = where, where
    ids, spans, cursor = list(head_ids), {}, 0
    for i in order:
        ids.extend(filler[cursor : placed[i]])
        cursor = placed[i]
        spans[i] = (len(ids), len(ids) + len(needle_ids[i]), needles[i][0])
        ids.extend(needle_ids[i])
    ids.extend(filler[cursor:])
    context_span = (len(head_ids), len(ids))
    ids.extend(tail_ids)
    return ids, {"needles": [spans[i] for i in range(len(needles))], "context": context_span}


# ----------------------------------------------------------------------------------------------
# the tasks
# ----------------------------------------------------------------------------------------------

NIAH_HEAD = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards.\n"
)


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _keys(rng: random.Random, words: list[str], count: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < count:
        key = f"{rng.choice(words)}-{rng.choice(words)}"
        if key not in keys:
            keys.append(key)
    return keys


def _depths(rng: random.Random, first: float, count: int) -> list[float]:
    """The asked depth first, the others uniformly at random."""
    return [first] + [rng.random() for _ in range(count - 1)]


def _join(names: list[str]) -> str:
    return ", ".join(names[:-1]) + ", and " + names[-1] if len(names) > 1 else names[0]


def niah(
    codec, task, length, index, seed, depth, max_new_tokens, haystack_kind, keys=1, values=1, queries=1, essays=None
):
    """Needles "One of the special magic numbers for <key> is: <7 digits>." in essays or noise."""
    rng = example_rng(seed, task, length, index)
    words = word_list(essays)
    units = essay_units(codec, essays) if haystack_kind == "essay" else noise_units(codec)
    names = _keys(rng, words, max(keys, queries))
    if values > 1:
        pairs = [(names[0], _number(rng, 7)) for _ in range(values)]
    else:
        pairs = [(name, _number(rng, 7)) for name in names]
    needles = [
        (d, f"One of the special magic numbers for {k} is: {v}.")
        for d, (k, v) in zip(_depths(rng, depth, len(pairs)), pairs)
    ]
    if queries > 1:
        asked = names[:queries]
        refs = [v for _, v in pairs[:queries]]
        tail = (
            f"\nWhat are all the special magic numbers for {_join(asked)} mentioned in the provided text? "
            f"The special magic numbers for {_join(asked)} mentioned in the provided text are"
        )
    elif values > 1:
        refs = [v for _, v in pairs]
        tail = (
            f"\nWhat are all the special magic numbers for {names[0]} mentioned in the provided text? "
            f"The special magic numbers for {names[0]} mentioned in the provided text are"
        )
    else:
        refs = [pairs[0][1]]
        tail = (
            f"\nWhat is the special magic number for {names[0]} mentioned in the provided text? "
            f"The special magic number for {names[0]} mentioned in the provided text is"
        )
    ids, meta = assemble(codec, task, length, NIAH_HEAD, tail, units, needles, max_new_tokens, rng)
    meta.update(depth=depth, haystack=haystack_kind, needle_texts=[t for _, t in needles])
    return Example(task, length, index, ids, refs, "string_match_all", max_new_tokens, meta)


def passkey(codec, task, length, index, seed, depth, max_new_tokens, essays=None):
    """A 5-digit pass key in repeated noise (InfiniteBench / Landmark style)."""
    rng = example_rng(seed, task, length, index)
    key = _number(rng, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    head = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n"
    )
    ids, meta = assemble(
        codec,
        task,
        length,
        head,
        "\nWhat is the pass key? The pass key is",
        noise_units(codec),
        [(depth, needle)],
        max_new_tokens,
        rng,
    )
    meta.update(depth=depth, needle_texts=[needle])
    return Example(task, length, index, ids, [key], "string_match_all", max_new_tokens, meta)


def variable_tracking(codec, task, length, index, seed, depth, max_new_tokens, hops=4, essays=None):
    """One chain VAR X0 = <5 digits>, VAR X1 = X0, ... (hops + 1 names) in noise; find every name."""
    rng = example_rng(seed, task, length, index)
    value = _number(rng, 5)
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    texts = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = {a}." for a, b in zip(names, names[1:])]
    later = sorted(depth + (1.0 - depth) * rng.random() for _ in range(hops))
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
    tail = (
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
        f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} variables "
        f"are assigned the value {value}, they are:"
    )
    ids, meta = assemble(
        codec, task, length, head, tail, noise_units(codec), list(zip([depth] + later, texts)), max_new_tokens, rng
    )
    meta.update(depth=depth, needle_texts=texts)
    return Example(task, length, index, ids, names, "string_match_all", max_new_tokens, meta)


def _fill_items(
    codec, prompt_budget: int, fixed: list[str], extra: Callable[[], list[str]], rng: random.Random, numbered: bool
):
    """Items (fixed + as many `extra()` groups as fit) shuffled, optionally numbered, encoded;
    dropped group by group until they fit `prompt_budget` tokens.  Returns ids, items."""
    groups = []
    while True:  # grow with a cheap per-item estimate, then check exactly
        items = fixed + [w for g in groups for w in g]
        estimate = sum(len(codec.encode(f" {len(items)}. {w}" if numbered else f" {w}")) for w in items[-8:]) / max(
            len(items[-8:]), 1
        )
        if len(items) * estimate >= prompt_budget:
            break
        groups.append(extra())
    while True:
        items = fixed + [w for g in groups for w in g]
        order = items[:]
        rng.shuffle(order)
        texts = [f" {i + 1}. {w}" if numbered else f" {w}" for i, w in enumerate(order)]
        encoded = codec.encode_batch(texts)
        total = sum(map(len, encoded))
        if total <= prompt_budget or not groups:
            break
        groups.pop()
    if total > prompt_budget:
        raise ConfigError(f"the fixed items need {total} tokens, more than the {prompt_budget} available")
    return [t for ids in encoded for t in ids], order


def common_words(
    codec, task, length, index, seed, depth, max_new_tokens, num_cw=10, freq_cw=30, freq_ucw=3, essays=None
):
    """A numbered word list: `num_cw` words appear `freq_cw` times, the rest `freq_ucw` times or
    once (filling the last tokens); name the `num_cw` most common.  freq_cw shrinks at short
    lengths so the common words fill at most half of the list."""
    rng = example_rng(seed, task, length, index)
    words = word_list(essays)
    pool = rng.sample(words, len(words))
    common, spare = pool[:num_cw], iter(pool[num_cw:])

    def rest() -> str:
        word = next(spare, None)
        if word is None:
            raise ConfigError(f"task {task!r}: the word list ({len(words)} words) runs out at length {length}")
        return word

    head = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n"
    )
    tail = (
        f"\nQuestion: What are the {num_cw} most common words in the above list? "
        f"Answer: The top {num_cw} words that appear most often in the list are:"
    )
    head_ids, tail_ids = codec.encode(head), codec.encode(tail)
    budget = length - max_new_tokens - len(head_ids) - len(tail_ids)
    per_item = len(codec.encode(f" {budget // 4}. {common[0]}"))
    freq = max(freq_ucw + 1, min(freq_cw, budget // (2 * num_cw * per_item)))
    if budget < num_cw * freq * per_item:
        raise ConfigError(
            f"task {task!r}: length {length} is too short; it needs at least "
            f"{length - budget + num_cw * freq * per_item} tokens"
        )
    fixed = [w for w in common for _ in range(freq)]
    body, order = _fill_items(codec, budget, fixed, lambda: [rest()] * freq_ucw, rng, numbered=True)
    # top up with words used once (still rarer than the common ones) until within an item of the budget
    while True:
        word = rest()
        item = codec.encode(f" {len(order) + 1}. {word}")
        if len(body) + len(item) > budget:
            break
        order, body = order + [word], body + item
    ids = head_ids + body + tail_ids
    meta = {"freq_cw": freq, "items": len(order), "context": (len(head_ids), len(head_ids) + len(body))}
    return Example(task, length, index, ids, common, "string_match_all", max_new_tokens, meta)


def frequent_words(codec, task, length, index, seed, depth, max_new_tokens, alpha=2.0, vocab=1000, essays=None):
    """Coded words drawn from a Zipf(alpha) law over `vocab` random 4-letter codes; name the three
    most frequent (regenerated until the top three counts are strictly above the fourth)."""
    import numpy as np

    rng = example_rng(seed, task, length, index)
    head = (
        "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words.\n"
    )
    tail = (
        "\nQuestion: What are the three most frequently appeared words in the above coded text? "
        "Answer: According to the coded text above, the three most frequently appeared words are:"
    )
    head_ids, tail_ids = codec.encode(head), codec.encode(tail)
    budget = length - max_new_tokens - len(head_ids) - len(tail_ids)
    codes = sorted({"".join(rng.choice(string.ascii_lowercase) for _ in range(4)) for _ in range(vocab)})
    rng.shuffle(codes)
    code_ids = codec.encode_batch([" " + c for c in codes])
    for attempt in range(100):
        draw = np.random.default_rng(rng.randrange(2**32))
        body, counts, picks = [], [0] * len(codes), []
        while True:
            ranks = draw.zipf(alpha, size=256)
            for rank in ranks[ranks <= len(codes)]:
                c = int(rank) - 1
                if len(body) + len(code_ids[c]) > budget:
                    break
                body += code_ids[c]
                counts[c] += 1
                picks.append(c)
            else:
                continue
            break
        top = sorted(range(len(codes)), key=lambda c: -counts[c])[:4]
        if counts[top[2]] > counts[top[3]]:
            break
    else:  # pragma: no cover - needs a pathological budget
        raise ConfigError(f"task {task!r}: no draw with a clear top three at length {length}")
    if not picks:
        raise ConfigError(f"task {task!r}: length {length} is too short")
    ids = head_ids + body + tail_ids
    meta = {"counts": {codes[c]: counts[c] for c in top[:3]}, "context": (len(head_ids), len(head_ids) + len(body))}
    return Example(task, length, index, ids, [codes[c] for c in top[:3]], "string_match_all", max_new_tokens, meta)


_HELDOUT_CACHE = CodecCache()


def heldout_stream(codec, essays: Sequence[str] | None = None) -> list[int]:
    """The held-out essays (or `essays`) joined by blank lines, as one id list."""

    def compute() -> list[int]:
        texts = essays
        if texts is None:
            from ..bundled import bundled_texts

            texts = bundled_texts("heldout")
        return codec.encode("\n\n".join(e.strip() for e in texts))

    return _HELDOUT_CACHE.get(codec, None if essays is None else tuple(essays), compute)


def perplexity(codec, task, length, index, seed, depth, max_new_tokens, essays=None):
    """`length` consecutive ids of the held-out essays from a seeded start (wrapping); scored by
    teacher-forced NLL per position bucket.  max_new_tokens is ignored."""
    stream = heldout_stream(codec, essays)
    if not stream:
        raise ConfigError("the held-out essays are empty")
    rng = example_rng(seed, task, length, index)
    start = rng.randrange(len(stream))
    ids = [stream[(start + i) % len(stream)] for i in range(length)]
    return Example(task, length, index, ids, [], "perplexity", 0, {"start": start, "stream_tokens": len(stream)})


# name -> (builder, default max_new_tokens, default keyword arguments)
TASKS: dict[str, tuple[Callable, int, dict]] = {
    "niah_single_noise": (niah, 32, {"haystack_kind": "noise"}),
    "niah_single_essay": (niah, 32, {"haystack_kind": "essay"}),
    "niah_multikey": (niah, 32, {"haystack_kind": "essay", "keys": 4}),
    "niah_multivalue": (niah, 64, {"haystack_kind": "essay", "values": 4}),
    "niah_multiquery": (niah, 64, {"haystack_kind": "essay", "keys": 4, "queries": 4}),
    "vt": (variable_tracking, 30, {}),
    "cwe": (common_words, 120, {}),
    "fwe": (frequent_words, 50, {}),
    "passkey": (passkey, 16, {}),
    "perplexity": (perplexity, 0, {}),
}


def generate_example(
    task: str,
    codec,
    length: int,
    index: int = 0,
    seed: int = 0,
    depth: float | None = None,
    max_new_tokens: int | None = None,
    essays: Sequence[str] | None = None,
    **options,
) -> Example:
    """Example `index` of `task` at `length` tokens (prompt + max_new_tokens).

    depth: the needle depth in [0, 1] (default: seeded uniform); options override the task's
    defaults (e.g. keys=, hops=, num_cw=); essays: haystack texts instead of the bundled essays.
    """
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; known tasks: {sorted(TASKS)} and longbench:<name>")
    builder, default_new, defaults = TASKS[task]
    new = default_new if max_new_tokens is None else max_new_tokens
    if depth is None:
        depth = example_rng(seed, task + "/depth", length, index).random()
    if length <= new:
        raise ConfigError(f"task {task!r}: length {length} must exceed max_new_tokens={new}")
    return builder(codec, task, length, index, seed, depth, new, essays=essays, **{**defaults, **options})
