"""LongBench (v1) from a local directory of the official JSONL files, or from `datasets`.

Each official file `<name>.jsonl` (LongBench-E: `<name>_e.jsonl`) holds one JSON object per line
with `input`, `context`, `answers`, `length`, `all_classes`, `_id`.  The prompt is the task's
official template; a prompt longer than the budget (`length - max_new_tokens`) keeps its first and
last halves (middle truncation, as LongBench's `pred.py` recommends; done on token ids here, without
its decode / re-encode round trip).  Chat templates are not applied (the official script wraps
prompts for chat models).  Metrics per task as LongBench's `eval.py`; for trec, triviaqa, samsum
and lsht only the first line of the prediction is scored.  Chinese tasks use character tokens where
the official code uses jieba (not a dependency here).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError, DataError
from .tasks import Example

PROMPTS = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: "
        "{context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
        "single phrase or sentence if possible. If the question cannot be answered based on the information in the "
        'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". '
        "Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as "
        "concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based "
        'on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", '
        '"no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:'
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the "
        "above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答："
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n"
        "\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give "
        "me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n"
        "\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give "
        "me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n"
        "\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give "
        "me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n"
        "\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one "
        "or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript "
        "in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write "
        "a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. "
        "The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read "
        "these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other "
        "words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of "
        "unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, "
        "3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract "
        "is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph "
        'that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer '
        "is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n"
        '{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

MAX_NEW_TOKENS = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

METRIC = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "dureader": "rouge_l_zh",
    "gov_report": "rouge_l",
    "qmsum": "rouge_l",
    "multi_news": "rouge_l",
    "vcsum": "rouge_l_zh",
    "trec": "classification",
    "triviaqa": "qa_f1",
    "samsum": "rouge_l",
    "lsht": "classification",
    "passage_retrieval_en": "retrieval",
    "passage_count": "count",
    "passage_retrieval_zh": "retrieval_zh",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}

FIRST_LINE_ONLY = ("trec", "triviaqa", "samsum", "lsht")
HUB_NAME = "THUDM/LongBench"


def _check_name(name: str) -> None:
    if name not in PROMPTS:
        raise ConfigError(f"unknown LongBench task {name!r}; known: {sorted(PROMPTS)}")


def expected_file(name: str, e: bool = False) -> str:
    return f"{name}_e.jsonl" if e else f"{name}.jsonl"


def check_directory(directory: str | Path, names: list[str], e: bool = False) -> None:
    """Raise a ValueError naming every missing file (and what the directory holds)."""
    for name in names:
        _check_name(name)
    path = Path(directory)
    if not path.is_dir():
        raise DataError(f"LongBench directory {str(path)!r} does not exist (expected the official <task>.jsonl files)")
    missing = [expected_file(n, e) for n in names if not (path / expected_file(n, e)).is_file()]
    if missing:
        present = sorted(p.name for p in path.glob("*.jsonl"))[:10]
        raise DataError(f"LongBench directory {str(path)!r} lacks {missing}; it holds {present or 'no .jsonl files'}")


def load_rows(name: str, source: str | Path | None = None, e: bool = False) -> list[dict]:
    """The rows of task `name`: from `source` (a directory of official JSONL files), else from
    `datasets.load_dataset("THUDM/LongBench", name, split="test")` (network or its cache)."""
    _check_name(name)
    if source is not None and str(source) != HUB_NAME:
        check_directory(source, [name], e)
        rows = []
        with open(Path(source) / expected_file(name, e), encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise DataError(f"{expected_file(name, e)} line {number} is not JSON: {err}") from None
        for number, row in enumerate(rows, 1):
            lacking = [k for k in ("context", "input", "answers") if k not in row]
            if lacking:
                raise DataError(f"{expected_file(name, e)} row {number} lacks the field(s) {lacking}")
        return rows
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "LongBench needs a local directory of the official JSONL files (longbench.dir) "
            "or the `datasets` package (pip install datasets)"
        ) from None
    subset = f"{name}_e" if e else name
    return [dict(row) for row in datasets.load_dataset(HUB_NAME, subset, split="test")]


def middle_truncate(ids: list[int], limit: int) -> list[int]:
    """Keep the first and last limit // 2 ids when `ids` is longer than `limit`."""
    if len(ids) <= limit:
        return list(ids)
    half = limit // 2
    return list(ids[:half]) + list(ids[len(ids) - half :])


def build_example(name: str, row: dict, index: int, codec, length: int, max_new_tokens: int | None = None) -> Example:
    """Example `index` of LongBench task `name`: the official prompt, middle-truncated so that
    prompt + max_new_tokens fits `length`."""
    new = MAX_NEW_TOKENS[name] if max_new_tokens is None else max_new_tokens
    if length <= new:
        raise ConfigError(f"LongBench {name}: length {length} must exceed max_new_tokens={new}")
    prompt = PROMPTS[name].format(context=row["context"], input=row["input"])
    full = codec.encode(prompt)
    ids = middle_truncate(full, length - new)
    meta = {
        "source_length": row.get("length"),
        "prompt_tokens": len(full),
        "truncated": len(full) > len(ids),
        "_id": row.get("_id"),
    }
    answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
    return Example(
        f"longbench:{name}",
        length,
        index,
        ids,
        [str(a) for a in answers],
        METRIC[name],
        new,
        meta,
        list(row.get("all_classes") or []),
    )


def prepare_prediction(name: str, prediction: str) -> str:
    """LongBench's scorer keeps only the first line for the few-shot tasks."""
    return prediction.lstrip("\n").split("\n")[0] if name in FIRST_LINE_ONLY else prediction
