"""The console script's context-cache parts, wired into `forecastkv/cli.py`:

* `add_context_cache_arguments(generate_parser)`: `generate --context-cache DIR` (with
  `--context-namespace`, `--context-max-bytes`);
* `run_generate_with_context_cache(args, model, tokenizer, ids)`: look the prompt up, prefill
  only the rest, generate, insert the prompt's blocks, save (a store that cannot be opened or
  saved is a miss with a message on stderr, never a failed generate);
* `register_context_cache_command(subparsers)`: `forecastkv context-cache {ls,du,rm,repair} DIR`,
  which read and rewrite the index under the namespace's lock (no model, no torch).

Importing this module imports neither torch nor the store.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_context_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The generate command's context-cache options."""
    parser.add_argument(
        "--context-cache",
        default=None,
        metavar="DIR",
        help="reuse prefilled prompt prefixes stored in DIR and store this prompt's blocks there "
        "(see `forecastkv context-cache`)",
    )
    parser.add_argument(
        "--context-namespace",
        default=None,
        metavar="NAME",
        help="the private part of DIR to use (default: your login name)",
    )
    parser.add_argument(
        "--context-max-bytes",
        default=None,
        type=int,
        metavar="N",
        help="cap on the stored blocks' bytes; least recently used blocks go first",
    )


def run_generate_with_context_cache(args, model, tokenizer, ids, out=None, err=None) -> int:
    """`forecastkv generate --context-cache DIR`: the prompt ids [1, T] looked up in the store,
    generate() prefilling only the tokens past the stored prefix, the prompt's full blocks
    inserted and the store saved.  args: the generate command's (offload, selector, max_new_tokens, stats
    and the context-cache options).  Prints the continuation to `out`, the counters to `err`."""
    import torch

    from ..modeling.modeling import CACHE_KWARG
    from .store import ContextStore

    out, err = out or sys.stdout, err or sys.stderr
    from ..modes import MODE_SELECTOR
    from .disk import ContextStoreError

    mode = getattr(args, "offload", None)
    # --selector (one of the store's, `usage.check_selector`), else the mode's, else the model's own
    selector = getattr(args, "selector", None) or MODE_SELECTOR.get(mode)

    reserve = ids.shape[1] + args.max_new_tokens
    try:
        store = ContextStore(
            model,
            args.context_cache,
            max_bytes=args.context_max_bytes,
            namespace=args.context_namespace,
            selector=selector,
        )
    except (ContextStoreError, OSError) as error:  # a store that cannot be opened is a miss, not a failed generate
        print(f"[context cache {args.context_cache}: not used ({error}); generating without it]", file=err)
        store = None
    start = time.perf_counter()
    if store is not None:
        cache, matched = store.lookup(ids, mode=mode, reserve=reserve)
    else:
        from ..inference.offloaded import new_cache

        cache, matched = new_cache(model, mode, selector), 0
        if mode is not None:
            cache.reserve(reserve)
    with torch.no_grad():
        generated = model.generate(
            ids,
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
            **({} if cache is None else {CACHE_KWARG: cache}),
        )
    seconds = time.perf_counter() - start
    added, directory = 0, None
    if store is not None:
        try:
            added = store.insert(cache, ids)
            directory = store.save()
        except (ContextStoreError, OSError) as error:  # the continuation is still right: say why nothing was stored
            print(f"[context cache {args.context_cache}: this prompt's blocks were not stored ({error})]", file=err)
    print(tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True), file=out)
    if getattr(args, "stats", False):
        print(
            f"[{ids.shape[1]} prompt tokens: {matched} from the context cache, {ids.shape[1] - matched} prefilled; "
            f"{generated.shape[1] - ids.shape[1]} new, {seconds:.1f}s]",
            file=err,
        )
        if directory is not None:
            stats = store.stats()
            print(
                f"[context cache {directory}: {stats['blocks']} blocks ({stats['bytes'] / 2**20:.2f} MiB), "
                f"{added} added, {stats['evictions']} evicted]",
                file=err,
            )
    return 0


# -- context-cache {ls, du, rm, repair}: the index only ---------------------------------------------
def _namespaces(args) -> list[str]:
    from . import disk

    if args.namespace is not None:
        return [disk.check_namespace_name(args.namespace)]
    return disk.list_namespaces(args.dir)


def _read(args, namespace: str) -> tuple[list[dict], dict]:
    """(the well-formed entries, the index) of a namespace, read under its shared lock."""
    from . import disk

    with disk.Namespace(args.dir, namespace, create=False) as space, space.lock(exclusive=False):
        index = disk.read_index(space)
    if index is None:
        raise disk.ContextStoreError(f"namespace {namespace!r} in {args.dir} has no index")
    good, _ = disk.check_entries(index)
    return good, index


def _readable(args, err) -> tuple[list[tuple[str, list[dict], dict]], int]:
    """(namespace, well-formed entries, index) of every readable namespace, and the exit status:
    1 if some could not be read (each named on `err` with what repairs it)."""
    from .disk import ContextStoreError

    found, status = [], 0
    for namespace in _namespaces(args):
        try:
            found.append((namespace, *_read(args, namespace)))
        except (ContextStoreError, OSError) as error:
            print(
                f"{namespace}: {error}; `forecastkv context-cache repair {args.dir} --namespace {namespace}` "
                "keeps its good blocks, `rm --all` empties it",
                file=err,
            )
            status = 1
    return found, status


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


def _ls(args, out=None, err=None) -> int:
    out = out or sys.stdout
    found, status = _readable(args, err or sys.stderr)
    for namespace, entries, index in found:
        identity = index.get("identity") or {}
        weights = str((identity.get("model") or {}).get("weights"))[:12]
        selector = (identity.get("geometry") or {}).get("selector")
        mib = sum(e["bytes"] for e in entries) / 2**20
        bad = len(index["entries"]) - len(entries)
        print(
            f"{namespace}: {len(entries)} blocks of {index.get('block_size')} tokens, {mib:.2f} MiB, "
            f"model {weights}, selector {selector}, {(identity.get('dtype') or {}).get('kv')}"
            + (f"; {bad} bad entries (repair drops them)" if bad else ""),
            file=out,
        )
        for chain in _chains(entries):
            print(
                f"  {chain[-1]['hash'][:16]}  {len(chain) * index['block_size']} tokens  "
                f"{sum(e['bytes'] for e in chain) / 2**20:.2f} MiB",
                file=out,
            )
    return status


def _du(args, out=None, err=None) -> int:
    out, total = out or sys.stdout, 0
    found, status = _readable(args, err or sys.stderr)
    for namespace, entries, _ in found:
        size = sum(entry["bytes"] for entry in entries)
        total += size
        print(f"{size}\t{namespace}", file=out)
    print(f"{total}\ttotal", file=out)
    return status


def _rm(args, out=None) -> int:
    """Remove blocks (with their descendants) by hash prefix (`ls` shows chain tips) or, with --all, every
    block of the namespace, under the namespace's exclusive lock (what saves take): the index is
    rewritten atomically first, then files no index names go.  --all works on a broken store."""
    from . import disk

    out = out or sys.stdout
    if args.namespace is None:
        raise SystemExit("context-cache rm needs --namespace")
    if not args.all and not args.hashes:
        raise SystemExit("context-cache rm needs --block HASH (see ls) or --all")
    with disk.Namespace(args.dir, args.namespace, create=False) as space, space.lock(exclusive=True):
        try:
            index = disk.read_index(space)
        except disk.BrokenIndex as error:
            if not args.all:
                raise disk.ContextStoreError(f"{error}; `rm --all` or `repair` works on it") from None
            index = None
        if index is None and not args.all:
            raise disk.ContextStoreError(f"namespace {args.namespace!r} in {args.dir} has no index")
        entries = [] if index is None else index["entries"]
        names = [entry.get("hash") for entry in entries if isinstance(entry, dict)]
        if args.all:
            doomed = set(names)
        else:
            doomed = set()
            for prefix in args.hashes:
                hits = [name for name in names if isinstance(name, str) and name.startswith(prefix)]
                if len(hits) != 1:
                    raise SystemExit(f"hash prefix {prefix!r} matches {len(hits)} blocks; give a longer one")
                doomed.add(hits[0])
            grown = True
            while grown:  # a removed block's descendants can never be reached again
                before = len(doomed)
                doomed |= {
                    entry["hash"] for entry in entries if isinstance(entry, dict) and entry.get("parent") in doomed
                }
                grown = len(doomed) > before
        kept = [entry for entry in entries if not (isinstance(entry, dict) and entry.get("hash") in doomed)]
        generation = (index or {}).get("generation", 0) + 1
        disk.write_index(
            space,
            disk.new_index(
                args.namespace, (index or {}).get("identity"), (index or {}).get("block_size"), kept, generation
            ),
        )
        freed = disk.remove_unlisted(
            space, {entry["file"] for entry in kept if isinstance(entry, dict) and isinstance(entry.get("file"), str)}
        )
    print(f"removed {len(doomed)} blocks ({freed / 2**20:.2f} MiB) from {args.namespace}", file=out)
    return 0


def _repair(args, out=None) -> int:
    """Make each namespace's store consistent whatever state it is in: keep the blocks whose index
    entries are well formed and whose files check out, drop the rest (`disk.repair`)."""
    from . import disk

    out = out or sys.stdout
    for namespace in _namespaces(args):
        kept, dropped, problems = disk.repair(args.dir, namespace)
        print(
            f"{namespace}: kept {kept} blocks, dropped {dropped}" + "".join(f"\n  {problem}" for problem in problems),
            file=out,
        )
    return 0


def register_context_cache_command(subparsers) -> argparse.ArgumentParser:
    """`forecastkv context-cache {ls,du,rm,repair} DIR [--namespace NAME]` (rm: `--block HASH` or `--all`)."""
    parser = subparsers.add_parser(
        "context-cache", help="list, size or remove stored prompt prefixes (generate --context-cache DIR)"
    )
    actions = parser.add_subparsers(
        dest="context_action", required=True, metavar="ACTION", help="what to do with the store in DIR"
    )
    for name, action, text in (
        ("ls", _ls, "namespaces and their chains of blocks"),
        ("du", _du, "bytes per namespace"),
        ("rm", _rm, "remove blocks with their descendants, or a whole namespace"),
        ("repair", _repair, "keep the good blocks of a damaged store, drop the rest"),
    ):
        sub = actions.add_parser(name, help=text, description=text)
        sub.add_argument("dir", help="the directory given to generate --context-cache")
        sub.add_argument("--namespace", default=None, help="one namespace (default: every one in DIR; rm needs it)")
        if name == "rm":
            sub.add_argument(
                "--block",
                dest="hashes",
                action="append",
                default=[],
                metavar="HASH",
                help="remove the block with this hash prefix and its descendants (ls prints chain tips); repeatable",
            )
            sub.add_argument("--all", action="store_true", help="every block of the namespace")
        sub.set_defaults(
            run=action
        )  # errors are ValueErrors (ContextStoreError) or SystemExit("..."): the console script prints them
    return parser
