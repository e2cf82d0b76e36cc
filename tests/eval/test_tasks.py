"""Generated tasks: token length within 1% of the target, needles at the asked depth (found in the
prompt itself: its text and token ids, not the generator's bookkeeping), references consistent
with the text, deterministic per seed, token caches that never mix up two tokenizers."""

import re
from collections import Counter

import pytest

from forecastkv.eval.codec import ByteCodec, TextCodec
from forecastkv.eval.tasks import NIAH_HEAD, NOISE, TASKS, generate_example

ESSAYS = [
    "Startups grow fast. Most of them fail anyway! Founders learn a lot from that. " * 30,
    "Painters study light and shadow. Good taste can be learned? Writing essays helps thinking. " * 30,
    " ".join(a + b + c + d for a in "bcdfgk" for b in "aeiou" for c in "lmnprst" for d in "aeiou") + ".",  # 1050 words
]
NEEDLE_TASKS = [
    "niah_single_noise",
    "niah_single_essay",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "passkey",
]
# every needle of a task as the prompt states it, and how many a prompt holds
NIAH_NEEDLE = r"One of the special magic numbers for [a-z]+-[a-z]+ is: \d{7}\."
NEEDLES = {
    "niah_single_noise": (NIAH_NEEDLE, 1),
    "niah_single_essay": (NIAH_NEEDLE, 1),
    "niah_multikey": (NIAH_NEEDLE, 4),
    "niah_multivalue": (NIAH_NEEDLE, 4),
    "niah_multiquery": (NIAH_NEEDLE, 4),
    "vt": (r"VAR [A-Z]{5} = (?:\d{5}|[A-Z]{5})\.", 5),
    "passkey": (r"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.", 1),
}


def find(ids, sub):
    """Every start of `sub` inside `ids`."""
    return [i for i in range(len(ids) - len(sub) + 1) if ids[i : i + len(sub)] == sub]


def needle_depths(codec, ex) -> dict[str, float]:
    """needle text -> its depth in the haystack, measured on the prompt alone.

    The context is what lies between the head (its last token holds the prompt's first newline)
    and the tail (its first token holds the only other one); the needles are found in its text by
    the task's pattern and then as token ids; depth = haystack tokens before a needle / haystack
    tokens (RULER's depth, needles not counted)."""
    pattern, count = NEEDLES[ex.task]
    newlines = [i for i, t in enumerate(ex.input_ids) if "\n" in codec.decode([t])]
    assert len(newlines) == 2, (ex.task, newlines)
    begin, end = newlines[0] + 1, newlines[1]
    texts = [m.group(0) for m in re.finditer(pattern, codec.decode(ex.input_ids[begin:end]))]
    assert len(texts) == len(set(texts)) == count, (ex.task, texts)
    spans = {}
    for text in texts:
        ids = codec.encode(" " + text)
        hits = find(ex.input_ids, ids)
        assert len(hits) == 1 and begin <= hits[0] and hits[0] + len(ids) <= end, (ex.task, text, hits)
        spans[text] = (hits[0], hits[0] + len(ids))
    haystack = (end - begin) - sum(b - a for a, b in spans.values())
    return {
        text: (a - begin - sum(y - x for x, y in spans.values() if y <= a)) / haystack for text, (a, _) in spans.items()
    }


def queried_needle(ex, depths: dict[str, float]) -> str:
    """The needle placed at the depth asked for: the one holding the first answer (the queried
    key's value, the pass key) or, in variable tracking, the one assigning the number."""
    if ex.task == "vt":
        [text] = [t for t in depths if re.fullmatch(rf"VAR {ex.references[0]} = \d+\.", t)]
    else:
        [text] = [t for t in depths if ex.references[0] in t]
    return text


def check_example(codec, task, length, depth, seed=0):
    ex = generate_example(task, codec, length, index=1, seed=seed, depth=depth, essays=ESSAYS)
    total = len(ex.input_ids) + ex.max_new_tokens
    assert abs(total - length) <= 0.01 * length, (task, length, total)
    if task in NEEDLE_TASKS:
        depths = needle_depths(codec, ex)
        # the queried needle sits at the depth asked for, within 1% of the haystack (the generator
        # moves it to a sentence start within 0.5%)
        measured = depths[queried_needle(ex, depths)]
        assert abs(measured - depth) <= 0.01, (task, measured, depth)
        # the other needles at their own (random) depths, as the generator reports them
        reported = {codec.decode(ex.input_ids[a:b]).strip(): d for a, b, d in ex.meta["needles"]}
        assert reported.keys() == depths.keys() and all(abs(depths[t] - reported[t]) <= 0.01 for t in depths), (
            task,
            depths,
            reported,
        )
        if task == "vt":  # the chain's later links come after its start
            assert min(depths.values()) >= depth - 0.01
        # every reference is in the prompt
        prompt = codec.decode(ex.input_ids)
        assert all(ref in prompt for ref in ex.references)
    return ex


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("length", [3000, 6000])
def test_byte_codec_lengths_and_depths(task, length):
    codec = ByteCodec(256)
    for depth in (0.0, 0.35, 1.0):
        check_example(codec, task, length, depth)


def test_smollm2_tokenizer_lengths_and_depths(bundled_path):
    from transformers import AutoTokenizer

    codec = TextCodec(AutoTokenizer.from_pretrained(bundled_path))
    for task in sorted(TASKS):
        for length in (1024, 8192):
            check_example(codec, task, length, 0.6)
    ex = generate_example("niah_single_essay", codec, 2048, depth=0.25)  # the bundled essays as haystack
    assert ex.input_ids[: len(codec.encode(NIAH_HEAD))] == codec.encode(NIAH_HEAD)
    depths = needle_depths(codec, ex)
    assert abs(depths[queried_needle(ex, depths)] - 0.25) <= 0.01, depths


def test_aggregation_references_match_counts():
    codec = ByteCodec(256)
    cwe = generate_example("cwe", codec, 6000, essays=ESSAYS)
    words = re.findall(r"\d+\. (\w+)", codec.decode(cwe.input_ids))
    counts = Counter(words)
    top = {w for w, _ in counts.most_common(10)}
    assert set(cwe.references) == top and min(counts[w] for w in top) > max(
        c for w, c in counts.items() if w not in top
    )
    fwe = generate_example("fwe", codec, 6000, essays=ESSAYS)
    begin, end = fwe.meta["context"]
    counts = Counter(codec.decode(fwe.input_ids[begin:end]).split())
    ranked = counts.most_common(4)
    assert [w for w, _ in ranked[:3]] == fwe.references and ranked[2][1] > ranked[3][1]
    vt = generate_example("vt", codec, 3000, essays=ESSAYS, depth=0.2)
    text = codec.decode(vt.input_ids)
    chain = re.findall(r"VAR (\w+) = (\w+)\.", text)
    assert [a for a, _ in chain] == vt.references and chain[0][1].isdigit()
    assert all(b == prev for (_, b), (prev, _) in zip(chain[1:], chain))


def test_determinism_and_seeds():
    codec = ByteCodec(256)
    a = generate_example("niah_multikey", codec, 3000, index=2, seed=5, essays=ESSAYS)
    b = generate_example("niah_multikey", codec, 3000, index=2, seed=5, essays=ESSAYS)
    c = generate_example("niah_multikey", codec, 3000, index=2, seed=6, essays=ESSAYS)
    assert a.input_ids == b.input_ids and a.references == b.references
    assert a.input_ids != c.input_ids


def test_perplexity_window_and_bad_input():
    codec = ByteCodec(256)
    ex = generate_example("perplexity", codec, 500, essays=ESSAYS)
    stream = codec.encode("\n\n".join(e.strip() for e in ESSAYS))
    start = ex.meta["start"]
    assert ex.input_ids == [stream[(start + i) % len(stream)] for i in range(500)]
    with pytest.raises(ValueError, match="unknown task 'niah_huge'"):
        generate_example("niah_huge", codec, 500)
    with pytest.raises(ValueError, match="length 200 is too short"):
        generate_example("niah_single_noise", codec, 200, essays=ESSAYS)
    with pytest.raises(ValueError, match=r"depth 1.5 must lie in \[0, 1\]"):
        generate_example("passkey", codec, 2000, depth=1.5)


@pytest.mark.parametrize("ids", ["real", "all equal"])
def test_token_caches_never_serve_another_codecs_ids(ids, monkeypatch):
    """A codec made after another was deleted gets its own token ids from every cached source
    (noise and essay sentences, the held-out stream; byte ids mod 256 vs mod 97 differ on
    lower-case letters).  "real": new codecs are made until one lands at the dead one's id, as
    CPython often (not always) gives it.  "all equal": `id()` as the tasks module sees it returns
    one value for every object, the reuse made certain, so a cache keyed by ids fails every time."""
    import gc

    from forecastkv.eval import tasks
    from forecastkv.eval.tasks import essay_units, heldout_stream, noise_units, split_sentences

    if ids == "all equal":
        monkeypatch.setattr(tasks, "id", lambda obj: 1, raising=False)

    def assert_own_ids(codec):
        assert noise_units(codec) == [codec.encode(s) for s in split_sentences(NOISE)]
        assert essay_units(codec, ESSAYS) == [codec.encode(s) for e in ESSAYS for s in split_sentences(e)]
        assert heldout_stream(codec, ESSAYS) == codec.encode("\n\n".join(e.strip() for e in ESSAYS))

    first = ByteCodec(256)
    assert_own_ids(first)
    dead = id(first)
    del first
    gc.collect()
    made = [ByteCodec(97)]
    while len(made) < 2000 and id(made[-1]) != dead:
        made.append(ByteCodec(97))
    second = made[-1]
    del made[:-1]
    assert_own_ids(second)
