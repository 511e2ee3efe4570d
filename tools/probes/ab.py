"""``probe ab``: an earlier revision's kernels next to this tree's, in one process, alternating.

``--base REV`` takes the ``src/kvwrite`` tree of a git revision (``git archive``; or ``--base
DIR``, a directory holding a kvwrite package, where there is no git history) and imports it as a
separately named package (``kvwrite_base``): its relative imports keep it whole. Its
implementations come from its own registry (revisions before the op axis have
``registry.get(name)`` and modules in ``kvwrite.impls``, later ones ``registry.get(op, name)``)
and are called with its own ``CacheDType`` (parsed by its ``dtypes.parse_kv_cache_dtype``: the
two packages' enum classes differ, and an old implementation handed this tree's enum would take
the wrong path without an error). Its ``torch.library`` namespace is renamed with the package
(``kvwrite_base::``), so loading it leaves this process's ``kvwrite::`` op alone.

Each point: both versions of each implementation on the same caches and inputs; before timing,
both write the same bytes (checked); then for each of ``--seeds`` input sets (set i = slot set i
of the benchmark's recipe) an untimed pass over every version, then each version's time per
call (:func:`.common.time_call`), the order of the versions reversed from one set to the next;
the figure is the mean over the sets. Small-T
differences of a few hundredths of a microsecond show this way, where separate runs move by
0.1-0.2 us.

    python -m tools.probes ab --base b3301bf --impls cuda,triton --heads 8,128 --tokens 2,64,4096 \\
        --kv auto,fp8
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import types
from collections.abc import Callable

import torch

from kvwrite import registry
from kvwrite.bench import report
from kvwrite.bench.engine import Parser
from kvwrite.bench.workload import LAYOUTS
from kvwrite.ops.reshape_and_cache_flash import OP
from kvwrite.testing.compare import differing_bytes

from . import common

__all__ = ["Package", "load_package", "written_rows", "check_same_bytes", "build_parser", "main"]

SRC = "src/kvwrite"


@dataclasses.dataclass
class Package:
    """A kvwrite tree imported as the package ``name``; its sources live in ``tmp`` (kept while
    the package is in use: Triton reads its kernels' source text)."""

    name: str
    label: str
    module: types.ModuleType
    tmp: tempfile.TemporaryDirectory

    @property
    def registry(self) -> types.ModuleType:
        """The package's registry with its ops registered: a lazy package (kvwrite/__init__'s
        __getattr__) registers them when its ``ops`` is imported; revisions before the op axis
        have no ``ops`` and register on import."""
        if importlib.util.find_spec(f"{self.name}.ops") is not None:
            importlib.import_module(f"{self.name}.ops")
        return importlib.import_module(f"{self.name}.registry")

    def impl(self, impl: str) -> types.ModuleType:
        """The module of implementation ``impl`` (its ``run``, ``available``, ``unsupported``),
        found through this package's own registry."""
        reg = self.registry
        info = reg.get(OP, impl) if hasattr(reg, "get_op") else reg.get(impl)
        module = info.module
        if module.startswith("kvwrite."):  # revisions that name modules absolutely
            module = self.name + module[len("kvwrite"):]
        return importlib.import_module(module)

    def cache_dtype(self, kv_cache_dtype: str):
        """``kv_cache_dtype`` as this package's own ``CacheDType``."""
        return importlib.import_module(f"{self.name}.dtypes").parse_kv_cache_dtype(kv_cache_dtype)


def _package_dir(path: str) -> str:
    for cand in (path, os.path.join(path, "kvwrite"), os.path.join(path, SRC)):
        if os.path.isfile(os.path.join(cand, "__init__.py")) and os.path.isfile(
                os.path.join(cand, "registry.py")):
            return cand
    raise common.ProbeError(f"--base: {path!r} holds no kvwrite package (looked for "
                            f"__init__.py and registry.py in it, kvwrite/ and {SRC}/)")


def _git_tree(rev: str, repo: str, dest: str) -> None:
    """Extract ``rev:src/kvwrite`` of the repository at ``repo`` into ``dest``."""
    try:
        top = subprocess.run(["git", "-C", repo, "rev-parse", "--show-toplevel"], check=True,
                             capture_output=True, text=True).stdout.strip()
        out = subprocess.run(["git", "-C", top, "archive", "--format=tar", f"{rev}:{SRC}"],
                             check=True, capture_output=True)
    except FileNotFoundError:
        raise common.ProbeError("--base: git is not installed; pass a directory holding a "
                                "kvwrite package instead of a revision") from None
    except subprocess.CalledProcessError as e:
        stderr = e.stderr if isinstance(e.stderr, str) else e.stderr.decode(errors="replace")
        msg = stderr.strip().splitlines()
        raise common.ProbeError(f"--base: git cannot read {rev}:{SRC} in {repo!r}: "
                                f"{msg[-1] if msg else e}") from None
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)


def _rename_namespace(root: str, name: str) -> None:
    """``kvwrite::`` (torch.library op names) and ``torch.ops.kvwrite.`` -> ``name``'s."""
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                new = re.sub(r"\bkvwrite::", f"{name}::", text)
                new = new.replace("torch.ops.kvwrite.", f"torch.ops.{name}.")
                if new != text:
                    with open(path, "w", encoding="utf-8") as fh:
                        fh.write(new)


def load_package(base: str, name: str = "kvwrite_base", repo: str = ".") -> Package:
    """Import the kvwrite tree of ``base`` (a git revision of the repository at ``repo``, or a
    directory holding a kvwrite package) as the package ``name``."""
    if not name.isidentifier() or name == "kvwrite":
        raise common.ProbeError(f"package name: expected an identifier other than kvwrite, "
                                f"got {name!r}")
    if name in sys.modules:
        raise common.ProbeError(f"package name: {name!r} is already imported in this process")
    tmp = tempfile.TemporaryDirectory(prefix="kvwrite-ab-")
    dest = os.path.join(tmp.name, name)
    if os.path.isdir(base):
        shutil.copytree(_package_dir(base), dest,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
        _git_tree(base, repo, dest)
        if not os.path.isfile(os.path.join(dest, "__init__.py")):
            raise common.ProbeError(f"--base: {base}:{SRC} holds no kvwrite package")
    _rename_namespace(dest, name)
    spec = importlib.util.spec_from_file_location(name, os.path.join(dest, "__init__.py"),
                                                  submodule_search_locations=[dest])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]
        raise
    label = os.path.basename(os.path.normpath(base)) if os.path.isdir(base) else base
    return Package(name, label, module, tmp)


# --------------------------------------------------------------------------------------------
# The byte check
# --------------------------------------------------------------------------------------------
def written_rows(call: Callable[[], None], key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slots: torch.Tensor) -> list[torch.Tensor]:
    """The bytes ``call`` writes at ``slots`` (all valid) of both caches, zeroed before it."""
    bs = key_cache.shape[1]
    blk, pg = slots // bs, slots % bs
    for c in (key_cache, value_cache):
        c[blk, pg] = 0
    call()
    return [c[blk, pg].contiguous().view(torch.uint8) for c in (key_cache, value_cache)]


def check_same_bytes(calls: dict[str, Callable[[], None]], key_cache: torch.Tensor,
                     value_cache: torch.Tensor, slots: torch.Tensor) -> str | None:
    """None when every call writes the bytes the first one writes at ``slots``, else which
    differs and how many bytes."""
    written = {name: written_rows(c, key_cache, value_cache, slots) for name, c in calls.items()}
    first, want = next(iter(written.items()))
    for name, got in written.items():
        n = sum(int(differing_bytes(g, w).sum()) for g, w in zip(got, want, strict=True))
        if n:
            return f"{name} wrote {n} bytes other than {first}"
    return None


# --------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ABRow:
    implementation: str
    base: str
    num_heads: int
    head_size: int
    layout: str
    kv_cache_dtype: str
    num_tokens: int
    base_us: float       # mean over the input sets
    new_us: float
    ratio: float         # new / base
    seeds: int
    num_blocks: int
    device: str


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = Parser(
        prog=prog, description="Time an earlier revision's implementations next to this tree's "
                               "in one process, alternating, after checking both write the "
                               "same bytes.")
    p.add_argument("--base", required=True,
                   help="a git revision (its src/kvwrite) or a directory holding a kvwrite "
                        "package")
    p.add_argument("--repo", default=".", help="the git checkout (default: the current directory)")
    p.add_argument("--impls", default="cuda,triton",
                   help="comma list of implementations (default: cuda,triton)")
    p.add_argument("--heads", default="8", help="comma list of KV head counts (default: 8)")
    p.add_argument("--head-size", type=int, default=128, help="(default: 128)")
    p.add_argument("--tokens", default="2,64", help="comma list of token counts (default: 2,64)")
    p.add_argument("--layouts", default="NHD,HND,packed",
                   help="comma list of NHD, HND, packed (default: all three)")
    p.add_argument("--kv", default="fp8", help="comma list of kv_cache_dtypes (default: fp8)")
    p.add_argument("--seeds", type=int, default=5, help="input sets per point (default: 5)")
    p.add_argument("--replays", type=int, default=30, help="timed graph replays (default: 30)")
    p.add_argument("--blocks", type=int, default=65536,
                   help="cache blocks of 16 slots (default: 65536, as kvwrite-bench)")
    p.add_argument("--json", default=None, metavar="PATH", help="write {meta, rows} as JSON")
    return p


def main(argv: list[str], prog: str) -> int:
    args = build_parser(prog).parse_args(argv)
    impls = common.timed_impls(args.impls)
    heads = common.int_list("--heads", args.heads)
    tokens = common.int_list("--tokens", args.tokens)
    layouts = common.str_list("--layouts", args.layouts, LAYOUTS)
    kvs = [k.strip() for k in args.kv.split(",") if k.strip()]
    for kv in kvs:
        common.point_shape(1, args.head_size, "NHD", kv, 1)  # ValueError names kv_cache_dtype
    if args.seeds < 1:
        raise common.ProbeError(f"--seeds: expected a positive integer, got {args.seeds}")
    common.require_gpu()
    name = next(n for n in (f"kvwrite_base{i or ''}" for i in range(1000))
                if n not in sys.modules)
    base = load_package(args.base, name, repo=args.repo)
    versions = [(f"{i}@{base.label}", base.impl(i).run, base.cache_dtype) for i in impls]
    versions += [(i, registry.get(OP, i).run, None) for i in impls]
    device = torch.cuda.get_device_name()
    print(f"# {device}  copy bandwidth {common.copy_bandwidth() / 1e9:.0f} GB/s; us per call, "
          f"mean over {args.seeds} input sets (hot L2), {args.blocks} blocks; ratio = "
          f"this tree / {base.label}", flush=True)
    headers = (["H", "T", "layout", "kv"] + [n for n, _, _ in versions]
               + [f"{i} ratio" for i in impls])
    lines, rows = [], []
    for h in heads:
        for kv in kvs:
            for layout in layouts:
                shape = common.point_shape(h, args.head_size, layout, kv, args.blocks)
                kc, vc = common.point_caches(shape)
                for t in tokens:
                    res = _time_point(versions, shape, t, kc, vc, args.seeds, args.replays)
                    ratios = [res[i] / res[f"{i}@{base.label}"] for i in impls]
                    lines.append([h, t, layout, kv] + [f"{res[n]:.3f}" for n, _, _ in versions]
                                 + [f"{r:.3f}" for r in ratios])
                    print("  " + " ".join(map(str, lines[-1])), flush=True)
                    rows += [ABRow(i, base.label, h, args.head_size, layout, kv, t,
                                   res[f"{i}@{base.label}"], res[i], r, args.seeds, args.blocks,
                                   device) for i, r in zip(impls, ratios, strict=True)]
                del kc, vc
                torch.cuda.empty_cache()
    print(report.format_table(headers, lines), flush=True)
    if args.json:
        report.write_json(args.json, rows, {"probe": "ab", "argv": argv, "base": base.label,
                                            "device_name": device})
    return 0


def _time_point(versions, shape, t: int, kc, vc, seeds: int, replays: int) -> dict[str, float]:
    """Mean µs per call of each version at one point; ProbeError if they write other bytes."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in versions}
    for seed, inp in enumerate(common.point_sets(shape, t, seeds)):
        calls = {}
        for name, run, parse in versions:
            cdt = shape.cache_dtype if parse is None else parse(shape.kv_cache_dtype)
            calls[name] = functools.partial(run, *inp.run_args(kc, vc, cdt))
        if seed == 0:
            diff = check_same_bytes(calls, kc, vc, inp.slot_mapping)
            if diff is not None:
                raise common.ProbeError(f"{diff} at H={shape.num_heads} T={t} {shape.layout_name} "
                                        f"{shape.kv_cache_dtype}")
        order = list(calls) if seed % 2 == 0 else list(calls)[::-1]
        # An untimed pass over every version first: without it the version timed first on a new
        # input set read 5-8% slower at H=8 T=4096 (triton, on an H100) even against an
        # identical copy of itself (an A/A run); with it, the order no longer shows.
        for name in order:
            common.time_call(calls[name], 3)
        for name in order:
            times[name].append(common.time_call(calls[name], replays))
    return {name: statistics.mean(v) * 1e6 for name, v in times.items()}
