"""The context cache: prefilled KV blocks kept by content (prefix hits) and on disk.

    from forecastkv.context import ContextStore
    store = ContextStore(model, "ctx-cache")
    cache, matched = store.lookup(ids)      # the longest stored prefix of ids
    ...                                      # generate(ids, cache=cache) prefills the rest
    store.insert(cache, ids); store.save()

Names are imported on first use, so `forecastkv.context.cli` (the console script's part) loads
without torch.
"""

__all__ = ["ContextStore", "ContextStoreError"]


def __getattr__(name: str):
    if name == "ContextStore":
        from .store import ContextStore

        return ContextStore
    if name == "ContextStoreError":
        from .disk import ContextStoreError

        return ContextStoreError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
