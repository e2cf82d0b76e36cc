"""vLLM-CPU's attention kernel as forecastkv's sparse decode over selected pages
(`serving/vllm_model.py:cpu_page_attention`) against its PyTorch reference
(`serving/paged.py:head_page_attention`), and the key layout it needs: what vLLM's own cache writer
stores, forecastkv's page view reads back (`kv_page_views` with the "vec" kernels keeps a page's keys
transposed).  No engine: the ops on a random pool."""

from __future__ import annotations

import pytest
import torch

PAGES, HEADS, PAGE = 12, 2, 32


@pytest.mark.parametrize("dim", [32, 64])
def test_the_page_view_reads_what_vllm_writes(dim):
    from vllm import _custom_ops as ops

    from forecastkv.serving.vllm_model import kv_page_views

    pool = torch.zeros(PAGES, HEADS, PAGE, 2 * dim)
    physical_keys, physical_values = pool.view(PAGES, HEADS, 2 * PAGE, dim).chunk(2, dim=2)
    keys, values = torch.randn(PAGES * PAGE, HEADS, dim), torch.randn(PAGES * PAGE, HEADS, dim)
    ops.cpu_attn_reshape_and_cache(keys, values, physical_keys, physical_values, torch.arange(PAGES * PAGE), "vec")
    key_view, value_view = kv_page_views(pool, "vec")  # [P, H, page, d]
    expected = lambda rows: rows.view(PAGES, PAGE, HEADS, dim).transpose(1, 2)  # noqa: E731
    torch.testing.assert_close(key_view, expected(keys), rtol=0, atol=0)
    torch.testing.assert_close(value_view, expected(values), rtol=0, atol=0)
    assert not torch.equal(kv_page_views(pool)[0], key_view)  # the plain view would read them wrong


@pytest.mark.parametrize("dim,group", [(32, 3), (64, 1)])
def test_the_kernel_equals_its_reference(dim, group):
    """Rows of 1 to 4 pages in any order, partial last pages, rows reading the same page."""
    from forecastkv.serving.paged import head_page_attention, head_pages
    from forecastkv.serving.vllm_model import cpu_page_attention, kv_page_views

    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(PAGES, HEADS, PAGE, 2 * dim, generator=generator)
    keys, values = (head_pages(view) for view in kv_page_views(pool, "vec"))
    entries = torch.randint(0, PAGES * HEADS, (5, 4), generator=generator)
    lengths = torch.tensor([1, PAGE, PAGE + 7, 3 * PAGE - 1, 4 * PAGE])
    q = torch.randn(5, group, dim, generator=generator)
    got = cpu_page_attention(pool, "vec")(q, entries, lengths)
    torch.testing.assert_close(got, head_page_attention(keys, values, q, entries, lengths), rtol=1e-5, atol=1e-5)
