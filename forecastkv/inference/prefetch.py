"""Prefetchers: run a layer's block fetch now (CPU, or synchronous modes) or on a CUDA side stream.

`launch(fetch)` returns a handle; `wait(handle)` makes the current stream wait for that fetch only.
"""

from __future__ import annotations

from typing import Callable

import torch


class SyncPrefetcher:
    """Runs the fetch at once on the current stream (CPU, or the synchronous baselines)."""

    def launch(self, fetch: Callable[[], None], keep_alive: tuple = ()):
        fetch()
        return None

    def wait(self, handle) -> None:
        return None


class StreamPrefetcher:
    """A CUDA side stream: the fetch waits for a ready event on the launching stream (the selection
    and block map are computed there), runs on the side stream and records a done event that
    only the consuming layer waits on."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def launch(self, fetch: Callable[[], None], keep_alive: tuple = ()):
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for tensor in keep_alive:  # allocated on the main stream, read here
                tensor.record_stream(self.stream)
            fetch()
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, handle) -> None:
        if handle is not None:
            torch.cuda.current_stream(self.device).wait_event(handle)


def make_prefetcher(device: torch.device, overlap: bool):
    """A side-stream prefetcher for CUDA devices when `overlap`, else the synchronous one."""
    device = torch.device(device)
    if overlap and device.type == "cuda" and torch.cuda.is_available():
        return StreamPrefetcher(device)
    return SyncPrefetcher()
