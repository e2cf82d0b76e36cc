"""The console script's context-cache parts, wired into `forecastkv/cli.py`:

* `add_context_cache_arguments(generate_parser)`: `generate --context-cache DIR` (with
  `--context-namespace`, `--context-max-bytes`);
* `run_generate_with_context_cache(args, model, tokenizer, ids)`: look the prompt up, prefill
  only the rest, generate, insert the prompt's blocks, save;
* `register_context_cache_command(subparsers)`: `forecastkv context-cache {ls,rm,du} DIR`, which
  read and rewrite the index only (no model, no torch).

Importing this module imports neither torch nor the store.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_context_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The generate command's context-cache options."""
    parser.add_argument("--context-cache", default=None, metavar="DIR",
                        help="reuse prefilled prompt prefixes stored in DIR and store this prompt's blocks there (see `forecastkv context-cache`)")
    parser.add_argument("--context-namespace", default=None, metavar="NAME", help="the private part of DIR to use (default: your login name)")
    parser.add_argument("--context-max-bytes", default=None, type=int, metavar="N", help="cap on the stored blocks' bytes; least recently used blocks go first")


def run_generate_with_context_cache(args, model, tokenizer, ids, out=None, err=None) -> int:
    """`forecastkv generate --context-cache DIR`: the prompt ids [1, T] looked up in the store,
    generate() prefilling only the tokens past the stored prefix, the prompt's full blocks
    inserted and the store saved.  args: the generate command's (offload, max_new_tokens, stats
    and the context-cache options).  Prints the continuation to `out`, the counters to `err`."""
    import torch

    from ..modeling.modeling import CACHE_KWARG
    from .store import ContextStore

    out, err = out or sys.stdout, err or sys.stderr
    mode = getattr(args, "offload", None)
    selector = None
    if mode is not None:
        from ..inference.offloaded import MODE_SELECTOR

        selector = MODE_SELECTOR.get(mode)
    store = ContextStore(model, args.context_cache, max_bytes=args.context_max_bytes, namespace=args.context_namespace, selector=selector)
    start = time.perf_counter()
    cache, matched = store.lookup(ids, mode=mode, reserve=ids.shape[1] + args.max_new_tokens)
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id, **{CACHE_KWARG: cache})
    seconds = time.perf_counter() - start
    added = store.insert(cache, ids)
    directory = store.save()
    print(tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True), file=out)
    if getattr(args, "stats", False):
        stats = store.stats()
        print(f"[{ids.shape[1]} prompt tokens: {matched} from the context cache, {ids.shape[1] - matched} prefilled; "
              f"{generated.shape[1] - ids.shape[1]} new, {seconds:.1f}s]", file=err)
        print(f"[context cache {directory}: {stats['blocks']} blocks ({stats['bytes'] / 2**20:.2f} MiB), {added} added, "
              f"{stats['evictions']} evicted]", file=err)
    return 0


# -- context-cache {ls, rm, du}: the index only ----------------------------------------------------
def _namespaces(args) -> list[str]:
    from . import disk

    if args.namespace is not None:
        return [disk.check_namespace_name(args.namespace)]
    return disk.list_namespaces(args.dir)


def _read(args, namespace: str) -> tuple[Path, dict]:
    from . import disk

    directory = disk.namespace_dir(args.dir, namespace, create=False)
    index = disk.read_index(directory, namespace)
    if index is None:
        raise disk.ContextStoreError(f"namespace {namespace!r} in {args.dir} has no index")
    return directory, index


def _chains(entries: list[dict]) -> list[list[dict]]:
    """Every stored chain, root to tip (one per block without children)."""
    by_name = {entry["hash"]: entry for entry in entries}
    parents = {entry["parent"] for entry in entries}
    chains = []
    for entry in entries:
        if entry["hash"] in parents:
            continue
        chain = [entry]
        while chain[-1]["parent"] is not None and chain[-1]["parent"] in by_name:
            chain.append(by_name[chain[-1]["parent"]])
        chains.append(chain[::-1])
    return chains


def _ls(args, out=None) -> int:
    out = out or sys.stdout
    for namespace in _namespaces(args):
        directory, index = _read(args, namespace)
        entries = index["entries"]
        block = index["block_size"]
        weights = index["identity"]["model"]["weights"][:12]
        print(f"{namespace}: {len(entries)} blocks of {block} tokens, {sum(e['bytes'] for e in entries) / 2**20:.2f} MiB, "
              f"model {weights}, selector {index['identity']['geometry']['selector']}, {index['identity']['dtype']['kv']}", file=out)
        for chain in _chains(entries):
            print(f"  {chain[-1]['hash'][:16]}  {len(chain) * block} tokens  {sum(e['bytes'] for e in chain) / 2**20:.2f} MiB", file=out)
    return 0


def _du(args, out=None) -> int:
    out = out or sys.stdout
    total = 0
    for namespace in _namespaces(args):
        _, index = _read(args, namespace)
        size = sum(entry["bytes"] for entry in index["entries"])
        total += size
        print(f"{size}\t{namespace}", file=out)
    print(f"{total}\ttotal", file=out)
    return 0


def _rm(args, out=None) -> int:
    """Remove blocks (with their descendants) by hash prefix (`ls` shows chain tips) or, with --all, every
    block of the namespace: the index is rewritten atomically first, then files go."""
    from . import disk

    out = out or sys.stdout
    if args.namespace is None:
        raise SystemExit("context-cache rm needs --namespace")
    directory, index = _read(args, args.namespace)
    entries = index["entries"]
    if args.all:
        doomed = {entry["hash"] for entry in entries}
    else:
        if not args.hashes:
            raise SystemExit("context-cache rm needs --block HASH (see ls) or --all")
        doomed = set()
        for prefix in args.hashes:
            hits = [entry["hash"] for entry in entries if entry["hash"].startswith(prefix)]
            if len(hits) != 1:
                raise SystemExit(f"hash prefix {prefix!r} matches {len(hits)} blocks; give a longer one")
            doomed.add(hits[0])
        grown = True
        while grown:  # a removed block's descendants can never be reached again
            before = len(doomed)
            doomed |= {entry["hash"] for entry in entries if entry["parent"] in doomed}
            grown = len(doomed) > before
    index["entries"] = [entry for entry in entries if entry["hash"] not in doomed]
    disk.write_index(directory, index)
    freed = disk.remove_unlisted(directory, {entry["file"] for entry in index["entries"]})
    print(f"removed {len(doomed)} blocks ({freed / 2**20:.2f} MiB) from {args.namespace}", file=out)
    return 0


def register_context_cache_command(subparsers) -> argparse.ArgumentParser:
    """`forecastkv context-cache {ls,rm,du} DIR [--namespace NAME]` (rm: `--block HASH` or `--all`)."""
    parser = subparsers.add_parser("context-cache", help="list, size or remove stored prompt prefixes (generate --context-cache DIR)")
    actions = parser.add_subparsers(dest="context_action", required=True)
    for name, action, text in (("ls", _ls, "namespaces and their chains of blocks"), ("du", _du, "bytes per namespace"),
                               ("rm", _rm, "remove blocks with their descendants, or a whole namespace")):
        sub = actions.add_parser(name, help=text)
        sub.add_argument("dir", help="the directory given to generate --context-cache")
        sub.add_argument("--namespace", default=None, help="one namespace (default: every one in DIR; rm needs it)")
        if name == "rm":
            sub.add_argument("--block", dest="hashes", action="append", default=[], metavar="HASH",
                             help="remove the block with this hash prefix and its descendants (ls prints chain tips); repeatable")
            sub.add_argument("--all", action="store_true", help="every block of the namespace")
        sub.set_defaults(run=action)  # errors are ValueErrors (ContextStoreError) or SystemExit("..."): the console script prints them
    return parser

