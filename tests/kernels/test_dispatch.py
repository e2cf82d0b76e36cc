"""The backend setting and its dispatch: get_backend / set_backend / use_backend, and the
`KernelSet` that `kernel_set(device)` resolves once per setting, device type and $TRITON_INTERPRET."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import forecastkv.kernels as K

from .conftest import DEVICE, needs_triton

KERNELS = (
    "block_gather",
    "row_store",
    "sparse_decode_slots",
    "sparse_decode_blocks",
    "block_scores",
    "agnostic_scores",
)


def test_backend_switches(monkeypatch):
    """One setting, three parts: the environment ($FORECASTKV_BACKEND), set_backend and
    use_backend (nested, restored), with clear errors for a bad part or choice."""
    monkeypatch.delenv("FORECASTKV_BACKEND", raising=False)
    assert [K.get_backend(part) for part in K.BACKEND_CHOICES] == ["auto", "auto", "auto"]
    with K.use_backend("reference"):
        assert K.get_backend() == "reference" and not K.use_triton(DEVICE)
        with K.use_backend("triton", decode="gather"):
            assert K.get_backend() == "triton" and K.get_backend("decode") == "gather"
        assert K.get_backend() == "reference" and K.get_backend("decode") == "auto"
    assert K.get_backend() == "auto"
    monkeypatch.setenv("FORECASTKV_BACKEND", "kernels=reference, prefill=chunked")
    assert (
        K.get_backend() == "reference" and K.get_backend("prefill") == "chunked" and K.get_backend("decode") == "auto"
    )
    K.set_backend("auto", prefill="flex")
    try:
        assert K.get_backend() == "auto" and K.get_backend("prefill") == "flex"
    finally:
        K.set_backend(None, prefill=None)
    assert K.get_backend() == "reference" and K.get_backend("prefill") == "chunked"
    monkeypatch.setenv("FORECASTKV_BACKEND", "kernels=cuda")
    with pytest.raises(ValueError, match=r"unknown kernels backend 'cuda' \(\$FORECASTKV_BACKEND\)"):
        K.get_backend()
    monkeypatch.setenv("FORECASTKV_BACKEND", "reference")
    with pytest.raises(ValueError, match=r"item 'reference' is not part=choice"):
        K.get_backend()
    monkeypatch.delenv("FORECASTKV_BACKEND")
    with pytest.raises(ValueError, match=r"unknown kernels backend 'fast'"):
        K.set_backend("fast")
    with pytest.raises(ValueError, match=r"unknown backend part 'attention'"):
        K.set_backend(attention="flex")


def test_auto_backend_choice(monkeypatch):
    monkeypatch.delenv("FORECASTKV_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not K.use_triton("cpu")
    with K.use_backend("triton"):
        with pytest.raises(RuntimeError, match="needs CUDA tensors or TRITON_INTERPRET=1"):
            K.use_triton("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.use_triton("cpu") == K._common.triton_available()


def test_kernel_set_holds_the_chosen_functions(monkeypatch):
    """The six kernel fields are the `*_reference` (or `*_triton`) functions themselves, and the
    path fields follow the decode and prefill parts: auto means CUDA."""
    monkeypatch.delenv("FORECASTKV_BACKEND", raising=False)
    with K.use_backend("reference"):
        chosen = K.kernel_set("cpu")
        assert [getattr(chosen, name) for name in KERNELS] == [getattr(K, f"{name}_reference") for name in KERNELS]
        assert (chosen.triton, chosen.stage1, chosen.decode_kernels, chosen.flex_prefill_allowed) == (False,) * 4
        on_cuda = K.kernel_set(torch.device("cuda"))  # a device type, nothing runs there
        assert not on_cuda.triton and not on_cuda.stage1 and on_cuda.decode_kernels and on_cuda.flex_prefill_allowed
    with K.use_backend("reference", decode="kernels", prefill="flex"):
        chosen = K.kernel_set("cpu")
        assert chosen.decode_kernels and chosen.flex_prefill_allowed
    with K.use_backend("reference", decode="gather", prefill="chunked"):
        chosen = K.kernel_set("cuda")
        assert not chosen.decode_kernels and not chosen.flex_prefill_allowed
    with pytest.raises(dataclasses.FrozenInstanceError):
        chosen.triton = True


@needs_triton
def test_kernel_set_forced_triton(monkeypatch):
    monkeypatch.delenv("FORECASTKV_BACKEND", raising=False)
    with K.use_backend("triton"):
        chosen = K.kernel_set(DEVICE)
        assert [getattr(chosen, name) for name in KERNELS] == [getattr(K, f"{name}_triton") for name in KERNELS]
        assert chosen.triton and chosen.stage1 and K.use_stage1_kernel(DEVICE)
    with K.use_backend("auto"):  # auto keeps the slow fused stage-1 kernel to CUDA
        assert K.kernel_set(DEVICE).stage1 == (DEVICE.type == "cuda")


def test_settings_are_read_once(monkeypatch):
    """The environment is parsed once per distinct value, and kernel_set is one object per setting
    and device type; a change of the environment or of use_backend gives a new one."""
    monkeypatch.setenv("FORECASTKV_BACKEND", "kernels=reference,decode=kernels")
    K._parse_environment.cache_clear()
    first = K.kernel_set("cpu")
    for _ in range(10):
        assert K.get_backend("decode") == "kernels" and K.kernel_set("cpu") is first
    assert K._parse_environment.cache_info().misses == 1
    assert first.decode_kernels and not first.triton
    monkeypatch.setenv("FORECASTKV_BACKEND", "kernels=reference,decode=gather")
    second = K.kernel_set("cpu")
    assert second is not first and not second.decode_kernels
    assert K._parse_environment.cache_info().misses == 2
    with K.use_backend(decode="kernels"):
        assert K.kernel_set("cpu").decode_kernels
    assert K.kernel_set("cpu") is second


def test_package_functions_use_the_kernel_set(monkeypatch):
    """`kernels.block_scores` and the other package-level functions run the kernel set's choice."""
    monkeypatch.delenv("FORECASTKV_BACKEND", raising=False)
    calls = []
    fake = dataclasses.replace(K.kernel_set("cpu"), agnostic_scores=lambda *args: calls.append(args) or "ran")
    monkeypatch.setattr(K, "kernel_set", lambda device: fake)
    assert K.agnostic_scores(torch.zeros(1, 2, 1), torch.zeros(1, dtype=torch.long), None, 3) == "ran"
    assert len(calls) == 1 and calls[0][3:] == (3, 0, None, True)
