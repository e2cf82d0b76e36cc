"""The selector registry (`forecastkv/selectors/__init__.py`): every name resolves to its `Selector`, a bad
name is refused by value, the names come without torch, and the layers that run a selector (attention,
the decoder loop, the caches, the runtime, the serving cache) never compare it with a name."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from forecastkv.modes import SELECTORS
from forecastkv.selectors import REGISTERED, get_selector
from forecastkv.selectors.base import SCORES_WITH, Selector

PACKAGE = Path(__file__).resolve().parents[2] / "forecastkv"
# where a selector runs: these ask it, and name none
RUNNERS = [
    "modeling/attention.py",
    "modeling/modeling.py",
    "modeling/cache.py",
    *(f"inference/{path.name}" for path in sorted((PACKAGE / "inference").glob("*.py"))),
    "serving/paged.py",
    "serving/step.py",
    "serving/page_offload.py",
]
NAME_SWITCH = re.compile(
    r"\b(selector|kind|next_kind|rule)\s*(==|!=)\s*[\"']"  # selector == "reuse"
    r"|\b(selector|kind|next_kind|rule)\s+(not\s+)?in\s*[(\[{]"  # kind in ("quest", "oracle")
)


@pytest.mark.parametrize("name", SELECTORS)
def test_every_registered_name_resolves_to_its_selector(name):
    rule = get_selector(name)
    assert isinstance(rule, Selector) and rule.name == name and get_selector(rule) is rule
    assert rule.scores_with in SCORES_WITH and rule.lag in (0, 1)
    # a rule that plans ahead scores what the layer before hands over, and before the row is stored
    assert rule.plans_ahead == (rule.scores_with != "queries")
    if rule.scores_with in ("forecast", "guessed-queries"):
        assert rule.lag == 1


def test_the_names_are_the_registry_and_none_passes_through():
    assert SELECTORS == tuple(REGISTERED) and get_selector(None) is None
    assert set(SELECTORS) >= {"query", "forecast", "oracle", "quest", "reuse", "speculate", "quest-forecast"}


@pytest.mark.parametrize("bad", ["Query", "quest_forecast", "", "dense"])
def test_an_unknown_name_is_refused_naming_it_and_the_registered_ones(bad):
    with pytest.raises(ValueError, match=rf"selector={bad!r} is not None or one of \('query', 'forecast'"):
        get_selector(bad)


def test_the_names_import_without_torch():
    code = "import sys, forecastkv.modes; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_layers_that_run_a_selector_never_compare_it_with_a_name():
    found = []
    for relative in RUNNERS:
        for number, line in enumerate((PACKAGE / relative).read_text().splitlines(), 1):
            if NAME_SWITCH.search(line.split("#")[0]):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "ask the Selector (forecastkv/selectors/base.py) instead:\n" + "\n".join(found)


def test_the_name_check_catches_a_switch():
    for line in ['if selector == "reuse":', "elif kind != 'quest'", 'if rule in ("quest", "oracle"):',
                 "x = 1 if next_kind == 'speculate' else 2"]:
        assert NAME_SWITCH.search(line), line
    for line in ["rule = get_selector(selector)", "if rule.plans_ahead:", 'out["query"] = selection']:
        assert not NAME_SWITCH.search(line), line


def test_a_selector_module_imports_first_in_a_fresh_process():
    """`forecastkv.selectors.base` pulls in `forecastkv.modeling`, which must not import it back at module
    level (an import circle only a fresh process shows)."""
    code = "import forecastkv.selectors.quest as q; print(q.SELECTOR.name)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "quest", done.stderr


def test_a_selector_stays_the_registered_object_through_copy_and_pickle():
    """Attention tells the rules apart by identity (`rule is get_selector("query")`), so a copied or
    unpickled config, cache or selector must hold the registered object, and a cache's name and rule agree."""
    import copy
    import pickle

    from forecastkv.modeling.cache import SparseCache
    from forecastkv.modeling.configuration import SparseConfig
    from tests.helpers import tiny_config, tiny_sparse

    for name in SELECTORS:
        rule = get_selector(name)
        assert copy.copy(rule) is rule and copy.deepcopy(rule) is rule and pickle.loads(pickle.dumps(rule)) is rule
    config = SparseConfig(**tiny_sparse(selector="speculate"))
    assert config.rule is get_selector("speculate") and copy.deepcopy(config).rule is config.rule
    cache = SparseCache(tiny_config(sparse_config=tiny_sparse()), selector="quest")
    assert cache.rule is get_selector("quest")
    cache.selector = None
    assert cache.rule is None
    with pytest.raises(ValueError, match=r"selector='nope' is not None or one of"):
        cache.selector = "nope"


def test_a_key_scoring_selector_without_its_rule_fails_when_made():
    from forecastkv.selectors.base import KeyScoringSelector

    class Forgetful(KeyScoringSelector):
        name = "forgetful"

    with pytest.raises(TypeError, match="selection"):
        Forgetful()
