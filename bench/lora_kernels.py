"""Launch-configuration sweep of the multi-LoRA decode kernels (issue 37), at the shapes a decode step launches.

    python -m bench.lora_kernels --device cuda --json sweep.json    # the H200 run: random:llama-8b, about 2-3 minutes
    python -m bench.lora_kernels --device cpu                        # smoke: random:llama-tiny in Triton's interpreter

Two decode forms, as bench/lora.py's runs take them (engine/lora/batch.py grouped_decode, "auto"):
- grouped: --batch tokens (64) spread over --num-adapters adapters (16), token j in slot j % adapters of a pool of
  --num-slots (the adapters' count, LLM(max_loras=...) in bench/lora.py): kernels/punica_shrink.py grouped_shrink,
  kernels/punica_expand.py grouped_expand_ and, for gate|up, grouped_expand_silu_and_mul. Batched steps keep the
  norms out of the projections (engine/models/linear.py fuses_norms), so no shrink fuses one;
- bgmv: one token of one adapter (batch-1 decode): bgmv_shrink with the RMSNorm fused on qkv and gate|up (the step
  fuses its norms into the projections), bgmv_expand_ and bgmv_expand_silu_and_mul.

Each form times the four projection groups of a Llama decoder layer as engine/lora/projection.py calls them: qkv
(q|k|v slices of the fused projection, R' = 3 x rank), o, gate|up (two slices, the SiLU product fused into the
expand) and down. For each kernel and shape, every configuration of the grid (kernels/lora_configs.py: the defaults
and what each launcher's keyword overrides mean) is first checked once against kernels/reference.py (a wrong output
or a launch error is reported and the configuration skipped), then timed: a CUDA graph of --layers launches (one per
decoder layer), each on its own copy of the slot pool's stacks, as in a step where the other layers' weights flush
L2 in between; microseconds per launch, median of --replays replays. A shrink runs its split of K (the number of
splits run is in each row); an expand is timed at each number of splits a valid shrink configuration runs, on
partial sums of that many splits, so a projection's best shrink + expand pair has splits that agree. The defaults'
and each projection's best pair are also timed chained in one graph (shrink then expand, per layer), and so is the
whole step's LoRA work (4 pairs x layers) with the default and with the best configurations.

Prints per kernel and shape the default configuration and its time, the best and its time, and the step's sum
(x layers) for both; --json writes every row (also after each form, so a run cut short leaves its results). The
grid is the command line's (--split-k, --block-m, --block-r, --block-n, --block-k, --num-warps). --jobs processes
compile the grid's kernels first into Triton's on-disk cache, so the timed process only loads them (giving up, and
leaving the rest to the timed process, at 60% of --time-budget); --time-budget stops sweeping (defaults are still
timed) once that many seconds have passed since the start. On Hopper the kernels launch with PDL, as in the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from bench.common import emit, log
from engine.lora.targets import group_shapes
from engine.random_models import random_model_config

# the launchers' keyword overrides (kernels/lora_configs.py); a shrink takes split_k, block_r and block_k, an expand
# block_n, the grouped kernels block_m, all num_warps
GPU_GRID = {"split_k": [1, 2, 4, 8, 16, 32, 64], "block_m": [16, 32, 64], "block_r": [16, 32, 64],
            "block_n": [64, 128, 256], "block_k": [64, 128, 256], "num_warps": [2, 4, 8]}
CPU_GRID = {"split_k": [1, 2], "block_m": [16], "block_r": [16], "block_n": [64], "block_k": [64], "num_warps": [4]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--model", default=None, help="random:<name> (default random:llama-8b, on cpu random:llama-tiny)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=None, help="the grouped form's tokens (default 64, on cpu 8)")
    p.add_argument("--num-adapters", type=int, default=None, help="distinct adapters among them (default 16, cpu 4)")
    p.add_argument("--num-slots", type=int, default=None, help="the slot pool's size (default: --num-adapters)")
    p.add_argument("--forms", nargs="+", choices=("grouped", "bgmv"), default=["grouped", "bgmv"])
    p.add_argument("--projections", nargs="+", choices=("qkv", "o", "gate_up", "down"),
                   default=["qkv", "o", "gate_up", "down"])
    p.add_argument("--layers", type=int, default=None,
                   help="launches per graph, each on its own copy of the stacks (default: the model's layers; cpu 1)")
    p.add_argument("--replays", type=int, default=None, help="timed graph replays per configuration (default 5)")
    for key in GPU_GRID:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, nargs="+", default=None,
                       help=f"grid values (default {GPU_GRID[key]}, on cpu {CPU_GRID[key]})")
    p.add_argument("--jobs", type=int, default=None,
                   help="processes compiling the grid first (default: min(12, cores - 2) on cuda; 0 on cpu)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds after which only default configurations are timed (default 210 on cuda, none on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.model = args.model or ("random:llama-tiny" if cpu else "random:llama-8b")
    args.batch = args.batch or (8 if cpu else 64)
    args.num_adapters = args.num_adapters or (4 if cpu else 16)
    args.num_slots = args.num_slots or args.num_adapters
    args.replays = args.replays or (1 if cpu else 5)
    for key in GPU_GRID:
        if getattr(args, key) is None:
            setattr(args, key, (CPU_GRID if cpu else GPU_GRID)[key])
    if args.jobs is None:
        args.jobs = 0 if cpu else max(0, min(12, (os.cpu_count() or 1) - 2))
    if args.time_budget is None:
        args.time_budget = 0.0 if cpu else 210.0
    if not args.model.startswith("random:"):
        p.error("--model: a random:<name> model (only its shapes are used)")
    if args.num_adapters > args.num_slots or args.num_adapters > args.batch:
        p.error("--num-adapters: at most --num-slots and --batch")
    return args


def _prepare_triton(device: str) -> None:
    """On cpu the kernels run in Triton's interpreter, which must be chosen before triton is first imported."""
    if device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")


def _ops():
    from kernels import lora_configs, punica_expand, punica_shrink, reference

    return lora_configs, punica_shrink, punica_expand, reference


# ---------------------------------------------------------------------------------------------------------------------
# the shapes and the tensors


@dataclass(frozen=True)
class Projection:
    name: str  # engine/lora/targets.py's group: qkv, o, gate_up, down
    k: int
    slice_widths: tuple[int, ...]

    @property
    def silu(self) -> bool:  # lora_add_silu_and_mul: the expand fuses the SiLU product
        return self.name == "gate_up"

    @property
    def takes_norm(self) -> bool:  # the projections after an RMSNorm (fused into them when the step fuses norms)
        return self.name in ("qkv", "gate_up")


@dataclass(frozen=True)
class Form:
    name: str  # "grouped" or "bgmv"
    batch: int
    adapters: int

    @property
    def fused_norm(self) -> bool:  # engine/models/linear.py fuses_norms: one token on one rank
        return self.batch == 1


class Case:
    """One form's launches of one projection: its activations, indices, output, and the shared stacks' copies."""

    def __init__(self, form: Form, proj: Projection, stacks: tuple[list, list], rank: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device, seed: int) -> None:
        from kernels.lora_indices import lora_indices

        _, _, _, reference = _ops()
        self.form, self.proj, self.rank = form, proj, rank
        self.a, self.b = stacks
        self.slots = (np.arange(form.batch) % form.adapters).astype(np.int32)
        self.indices = lora_indices(self.slots, device, one_token_per_seq=True, num_slots=num_slots,
                                    grouped=form.name == "grouped")
        gen = torch.Generator(device=device).manual_seed(seed)
        k, t = proj.k, form.batch
        self.x = torch.randn(t, k, generator=gen, device=device).to(dtype)
        self.norm = None
        if form.fused_norm and proj.takes_norm:
            self.norm = ((torch.rand(k, generator=gen, device=device) + 0.5).to(dtype), 1e-5)
        self.offsets_host = [0, *np.cumsum(proj.slice_widths).tolist()]
        self.offsets = torch.tensor(self.offsets_host, dtype=torch.int32, device=device)
        xs = self.x.float() if self.norm is None else self.x.float() * self.norm[0].float()
        self._unnormed = reference.lora_shrink(xs, self.a[0].float(), self.indices.token_slots)  # [T, R']
        self._squares = (self.x.float() ** 2).sum(1)
        normed = self.x.float() if self.norm is None else reference.rms_norm(self.x.float(), self.norm[0].float(),
                                                                             self.norm[1])
        self.expected_rows = reference.lora_shrink(normed, self.a[0].float(), self.indices.token_slots)
        delta = torch.zeros(t, self.offsets_host[-1], device=device)
        reference.lora_expand_(delta, self.expected_rows, self.b[0].float(), self.indices.token_slots,
                               self.offsets_host, rank)
        self.expected_delta = delta
        # the base projection's output, of the LoRA term's scale (so a wrong term shows in the check)
        self.y0 = (torch.randn(delta.shape, generator=gen, device=device) * delta.std().clamp_min(1e-3)).to(dtype)
        self.y = self.y0.clone()  # what the timed launches add into
        self._partials: dict[int, Any] = {}

    @property
    def shrink_kernel(self) -> str:
        return f"{self.form.name}_shrink"

    @property
    def expand_kernel(self) -> str:
        silu = "_silu_and_mul" if self.proj.silu else "_"
        return f"{self.form.name}_expand{silu}"

    @property
    def ranks(self) -> int:  # R': the shrink's output ranks
        return self.a[0].shape[1]

    @property
    def expand_n(self) -> int:  # the expand's columns as its config rule sees them: the widest slice, or a half
        return self.offsets_host[-1] // 2 if self.proj.silu else max(self.proj.slice_widths)

    # -- launches

    def shrink(self, cfg: dict, copy: int = 0):
        _, punica_shrink, _, _ = _ops()
        fn = punica_shrink.grouped_shrink if self.form.name == "grouped" else punica_shrink.bgmv_shrink
        return fn(self.x, self.a[copy], self.indices, norm=self.norm, **cfg)

    def expand(self, cfg: dict, shrunk, copy: int = 0, y: torch.Tensor | None = None):
        _, _, punica_expand, _ = _ops()
        y = self.y if y is None else y
        grouped = self.form.name == "grouped"
        if self.proj.silu:
            fn = punica_expand.grouped_expand_silu_and_mul if grouped else punica_expand.bgmv_expand_silu_and_mul
            return fn(y, shrunk, self.b[copy], self.indices, self.rank, **cfg)
        fn = punica_expand.grouped_expand_ if grouped else punica_expand.bgmv_expand_
        fn(y, shrunk, self.b[copy], self.indices, self.offsets, self.offsets_host, self.rank, **cfg)
        return y

    def partials(self, num_splits: int):
        """A SplitShrunk of num_splits splits whose sums are the exact shrunk rows (each split an equal share): what
        the expand reads, whichever shrink configuration would have written it."""
        if num_splits not in self._partials:
            from kernels.punica_shrink import SplitShrunk

            t, r = self._unnormed.shape
            p = torch.empty(num_splits, t, r + 1, dtype=torch.float32, device=self.x.device)
            p[:, :, :r] = self._unnormed / num_splits
            p[:, :, r] = self._squares / num_splits
            self._partials[num_splits] = SplitShrunk(p, self.proj.k, None if self.norm is None else self.norm[1])
        return self._partials[num_splits]

    # -- configurations

    def shrink_config(self, cfg: dict):
        lora_configs = _ops()[0]
        if self.form.name == "grouped":
            return lora_configs.grouped_shrink_config(self.a[0].shape[0], self.proj.k, self.ranks, **cfg)
        return lora_configs.bgmv_shrink_config(self.form.batch, self.proj.k, self.ranks, **cfg)

    def num_splits(self, cfg: dict) -> int:
        resolved = self.shrink_config(cfg)
        return _ops()[0].split_layout(self.proj.k, resolved.split_k, resolved.block_k)[1]

    def expand_config(self, cfg: dict):
        lora_configs = _ops()[0]
        rule = getattr(lora_configs, f"{self.expand_kernel.rstrip('_').replace('_and_mul', '')}_config")
        return rule(self.expand_n, self.rank, **cfg)

    def shrink_grid(self, grid: dict) -> list[dict]:
        """The grid's shrink configurations, one per distinct launch (the default first, as {})."""
        lora_configs = _ops()[0]
        cap = lora_configs.rank_block(self.ranks)  # a block of more ranks than that only masks
        block_ms = grid["block_m"] if self.form.name == "grouped" else [None]
        seen, out = {self._shrink_key({})}, [{}]
        for split_k, block_m, block_r, block_k, warps in itertools.product(
                grid["split_k"], block_ms, grid["block_r"], grid["block_k"], grid["num_warps"]):
            if block_r > cap:
                continue
            cfg = {"split_k": split_k, "block_r": block_r, "block_k": block_k, "num_warps": warps}
            if block_m is not None:
                cfg["block_m"] = block_m
            key = self._shrink_key(cfg)
            if key not in seen:
                seen.add(key)
                out.append(cfg)
        return out

    def _shrink_key(self, cfg: dict) -> tuple:
        c = self.shrink_config(cfg)
        k_per_split, _ = _ops()[0].split_layout(self.proj.k, c.split_k, c.block_k)
        return k_per_split, c.block_m, c.block_r, c.block_k, c.num_warps

    def expand_grid(self, grid: dict) -> list[dict]:
        block_ms = grid["block_m"] if self.form.name == "grouped" else [None]
        seen, out = {tuple(asdict(self.expand_config({})).values())}, [{}]
        for block_m, block_n, warps in itertools.product(block_ms, grid["block_n"], grid["num_warps"]):
            cfg = {"block_n": block_n, "num_warps": warps}
            if block_m is not None:
                cfg["block_m"] = block_m
            key = tuple(asdict(self.expand_config(cfg)).values())
            if key not in seen:
                seen.add(key)
                out.append(cfg)
        return out

    # -- checks against kernels/reference.py: relative error of the output

    def check_shrink(self, cfg: dict) -> float:
        with _poisoned_outputs():
            got = self.shrink(cfg).rows()
        return _rel_err(got, self.expected_rows)

    def check_expand(self, cfg: dict, num_splits: int) -> float:
        _, _, _, reference = _ops()
        y = self.y0.clone()
        with _poisoned_outputs():
            out = self.expand(cfg, self.partials(num_splits), y=y)
        if self.proj.silu:
            return _rel_err(out, reference.silu_and_mul(self.y0.float() + self.expected_delta))
        return _rel_err(out.float() - self.y0.float(), self.expected_delta)


@contextlib.contextmanager
def _poisoned_outputs() -> Iterator[None]:
    """torch.empty returns NaN-filled floating tensors meanwhile, so an output element a configuration leaves
    unwritten fails the check (rather than passing on the caching allocator's block of the last configuration's
    correct output)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = empty


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return err if err == err else float("inf")  # NaN: unwritten or broken output


def build_cases(settings: dict, copies: int) -> dict[tuple[str, str], Case]:
    """Every (form, projection) case; the stacks of a projection (copies of one random draw) are shared by the
    forms, as the slot pool's are by the kernels."""
    device = torch.device(settings["device"])
    dtype = torch.bfloat16 if settings["device"] == "cuda" else torch.float32
    cfg = random_model_config(settings["model"].removeprefix("random:"))
    shapes = group_shapes(cfg)
    rank, num_slots = settings["rank"], settings["num_slots"]
    forms = {"grouped": Form("grouped", settings["batch"], settings["num_adapters"]), "bgmv": Form("bgmv", 1, 1)}
    gen = torch.Generator(device=device).manual_seed(settings["seed"])
    cases = {}
    for pi, name in enumerate(settings["projections"]):
        shape = shapes[name]
        proj = Projection(name, shape.in_features, tuple(shape.slice_widths))
        a = (torch.randn(num_slots, len(proj.slice_widths) * rank, proj.k, generator=gen, device=device)
             / proj.k ** 0.5).to(dtype)
        b = (torch.randn(num_slots, sum(proj.slice_widths), rank, generator=gen, device=device) * 0.05).to(dtype)
        stacks = ([a] + [a.clone() for _ in range(copies - 1)], [b] + [b.clone() for _ in range(copies - 1)])
        for fi, form_name in enumerate(settings["forms"]):
            cases[form_name, name] = Case(forms[form_name], proj, stacks, rank, num_slots, dtype, device,
                                          settings["seed"] + 100 * pi + fi)
    return cases


# ---------------------------------------------------------------------------------------------------------------------
# timing


def time_us(device: str, launch: Callable[[int], object], copies: int, replays: int, per: int | None = None) -> float:
    """Microseconds per launch (per `per` launches: copies by default) of launch(copy) for copy 0..copies-1, captured
    in one CUDA graph and replayed (median of replays); on cpu the wall time of one eager pass."""
    per = copies if per is None else per
    if device != "cuda":
        start = time.perf_counter()
        for i in range(copies):
            launch(i)
        return (time.perf_counter() - start) * 1e6 / per
    for i in range(copies):  # loads the kernels outside the capture
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            launch(i)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per)
    del graph
    return statistics.median(times)


def _describe_shrink(c, num_splits: int) -> str:
    m = f" M{c.block_m}" if c.block_m else ""
    return f"split {c.split_k}->{num_splits}{m} R{c.block_r} K{c.block_k} w{c.num_warps}"


def _describe_expand(c, num_splits: int) -> str:
    m = f"M{c.block_m} " if c.block_m else ""
    return f"{m}N{c.block_n} w{c.num_warps} @{num_splits} splits"


# ---------------------------------------------------------------------------------------------------------------------
# compiling first, in worker processes


_WORKER_CASES: dict | None = None


def _worker_init(settings: dict) -> None:
    global _WORKER_CASES
    _prepare_triton(settings["device"])
    _WORKER_CASES = build_cases(settings, copies=1)


def _compile_group(group: list[tuple]) -> int:
    """Runs each launch of a group once (the first compiles, the rest reuse it); returns how many failed."""
    failed = 0
    for form, proj, kind, cfg, num_splits in group:
        case = _WORKER_CASES[form, proj]
        try:
            if kind == "shrink":
                case.shrink(cfg)
            else:
                case.expand(cfg, case.partials(num_splits), y=case.y0.clone())
        except Exception:  # the timed process reports it
            failed += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return failed


def _splits_class(n: int) -> int:
    """How Triton specializes an integer argument: 1, a multiple of 16, or neither."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


def compile_groups(cases: dict, grid: dict) -> list[list[tuple]]:
    """Every launch the sweep makes (an expand at every number of splits any shrink configuration runs), grouped by
    the compiled kernel they share as far as the launch tells (kernel, fused norm, compile-time blocks and warps, the
    splits' specialization), so that no two workers compile the same kernel."""
    groups: dict[tuple, list[tuple]] = {}
    for (form, proj), case in cases.items():
        norm = case.norm is not None
        shrinks = case.shrink_grid(grid)
        for cfg in shrinks:
            c = case.shrink_config(cfg)
            key = (case.shrink_kernel, norm, c.block_m, c.block_r, c.block_k, c.num_warps)
            groups.setdefault(key, []).append((form, proj, "shrink", cfg, 0))
        splits = sorted({case.num_splits(cfg) for cfg in shrinks})
        for cfg in case.expand_grid(grid):
            c = case.expand_config(cfg)
            for n in splits:
                key = (case.expand_kernel, norm, c.block_m, c.block_n, c.num_warps, _splits_class(n))
                groups.setdefault(key, []).append((form, proj, "expand", cfg, n))
    return list(groups.values())


def precompile(settings: dict, groups: list[list[tuple]], jobs: int, seconds: float) -> None:
    """Fills Triton's on-disk cache from worker processes, so the timed process only loads the kernels; gives up
    after `seconds` (0: no limit), leaving the rest for the timed process to compile."""
    if jobs < 1 or not groups:
        return
    started = time.perf_counter()
    groups = list(groups)
    random.Random(0).shuffle(groups)  # mixes the slow compiles (wide tiles, the dots) over the workers
    failed = done = 0
    pool = multiprocessing.get_context("spawn").Pool(jobs, initializer=_worker_init, initargs=(settings,))
    try:
        results = pool.imap_unordered(_compile_group, groups)
        while done < len(groups):
            left = seconds - (time.perf_counter() - started) if seconds else None
            if left is not None and left <= 0:
                raise multiprocessing.TimeoutError
            failed += results.next(timeout=left)
            done += 1
            if done % 50 == 0:
                log(f"  compiled {done}/{len(groups)} kernels")
    except multiprocessing.TimeoutError:
        log(f"  compiling: out of time after {done} of {len(groups)} kernels; the rest compile when timed")
    finally:
        pool.terminate()
        pool.join()
    log(f"compiled {done} kernels ({sum(map(len, groups))} launches) with {jobs} processes in "
        f"{time.perf_counter() - started:.1f} s ({failed} launches failed: reported below)")


# ---------------------------------------------------------------------------------------------------------------------
# the sweep


class Sweep:
    def __init__(self, args: argparse.Namespace, cases: dict, started: float) -> None:
        self.args, self.cases, self.started = args, cases, started
        self.grid = {key: getattr(args, key) for key in GPU_GRID}
        self.rows: list[dict] = []
        self.skipped_for_time = 0
        self.tolerance = 1e-2 if args.device == "cuda" else 1e-3

    def over_budget(self) -> bool:
        return bool(self.args.time_budget) and time.perf_counter() - self.started > self.args.time_budget

    def _measure(self, row: dict, check: Callable[[], float], launch: Callable[[int], object]) -> dict:
        try:
            err = check()
        except Exception as e:  # a launch error (compile, resources): reported, not timed
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            if "CUDA error" in row["error"] or "illegal" in row["error"]:
                raise  # the context is gone: nothing after this would run
            return row
        row["rel_err"] = err
        if not err <= self.tolerance:
            row["error"] = f"wrong output: relative error {err:.3g} (tolerance {self.tolerance:g})"
            return row
        row["us"] = round(time_us(self.args.device, launch, self.args.layers, self.args.replays), 3)
        return row

    def _base_row(self, case: Case, kernel: str) -> dict:
        return {"form": case.form.name, "batch": case.form.batch, "adapters": case.form.adapters,
                "projection": case.proj.name, "kernel": kernel, "k": case.proj.k, "ranks": case.ranks,
                "n": case.offsets_host[-1], "fused_norm": case.norm is not None, "us": None, "error": None}

    def shrinks(self, case: Case) -> list[dict]:
        rows = []
        for i, cfg in enumerate(case.shrink_grid(self.grid)):
            if i and self.over_budget():
                self.skipped_for_time += 1
                continue
            resolved = case.shrink_config(cfg)
            row = self._base_row(case, case.shrink_kernel)
            row.update(default=not cfg, config=asdict(resolved), num_splits=case.num_splits(cfg),
                       overrides=cfg, label=_describe_shrink(resolved, case.num_splits(cfg)))
            rows.append(self._measure(row, lambda: case.check_shrink(cfg),
                                      lambda copy, cfg=cfg: case.shrink(cfg, copy)))
        self.rows += rows
        return rows

    def expands(self, case: Case, splits: list[int], default_splits: int) -> list[dict]:
        rows = []
        configs = case.expand_grid(self.grid)
        for n in [default_splits] + [s for s in splits if s != default_splits]:
            shrunk = case.partials(n)
            for i, cfg in enumerate(configs):
                if (i or n != default_splits) and self.over_budget():
                    self.skipped_for_time += 1
                    continue
                resolved = case.expand_config(cfg)
                row = self._base_row(case, case.expand_kernel)
                row.update(default=not cfg, config=asdict(resolved), num_splits=n, overrides=cfg,
                           label=_describe_expand(resolved, n))
                rows.append(self._measure(row, lambda cfg=cfg, n=n: case.check_expand(cfg, n),
                                          lambda copy, cfg=cfg, shrunk=shrunk: case.expand(cfg, shrunk, copy)))
        self.rows += rows
        return rows

    def projection(self, case: Case) -> dict:
        """Sweeps one case; returns its summary: default and best shrink, expand and pair."""
        log(f"{case.form.name} {case.proj.name}: shrink grid")
        shrinks = self.shrinks(case)
        ok_shrinks = [r for r in shrinks if r["us"] is not None]
        default_shrink = next(r for r in shrinks if r["default"])
        if default_shrink["us"] is None:
            raise RuntimeError(f"{case.shrink_kernel} {case.proj.name}: the default config failed: "
                               f"{default_shrink['error']}")
        splits = sorted({r["num_splits"] for r in ok_shrinks})
        log(f"{case.form.name} {case.proj.name}: expand grid at {splits} splits")
        expands = self.expands(case, splits, default_shrink["num_splits"])
        ok_expands = [r for r in expands if r["us"] is not None]
        default_expand = next(r for r in expands if r["default"] and r["num_splits"] == default_shrink["num_splits"])
        if default_expand["us"] is None:
            raise RuntimeError(f"{case.expand_kernel} {case.proj.name}: the default config failed: "
                               f"{default_expand['error']}")
        best_expand_at = {}
        for r in ok_expands:
            if r["num_splits"] not in best_expand_at or r["us"] < best_expand_at[r["num_splits"]]["us"]:
                best_expand_at[r["num_splits"]] = r
        pairs = [(s["us"] + best_expand_at[s["num_splits"]]["us"], s, best_expand_at[s["num_splits"]])
                 for s in ok_shrinks if s["num_splits"] in best_expand_at]
        _, best_s, best_e = min(pairs, key=lambda p: p[0])
        summary = {
            "shrink_kernel": case.shrink_kernel, "expand_kernel": case.expand_kernel,
            "shrink_default": _brief(default_shrink), "shrink_best": _brief(min(ok_shrinks, key=lambda r: r["us"])),
            "expand_default": _brief(default_expand),
            "expand_best_at_default_splits": _brief(best_expand_at[default_shrink["num_splits"]]),
            "pair_default_sum_us": round(default_shrink["us"] + default_expand["us"], 3),
            "pair_best": {"shrink": _brief(best_s), "expand": _brief(best_e),
                          "sum_us": round(best_s["us"] + best_e["us"], 3)},
            "errors": sum(r["error"] is not None for r in shrinks + expands),
        }
        summary["pair_default_chained_us"] = self.pair_us(case, default_shrink, default_expand)
        summary["pair_best"]["chained_us"] = self.pair_us(case, best_s, best_e)
        return summary

    def pair_us(self, case: Case, shrink_row: dict, expand_row: dict) -> float:
        """The shrink then the expand of one projection, chained in one graph over the layers: per layer."""
        s, e = shrink_row["overrides"], expand_row["overrides"]
        return round(time_us(self.args.device, lambda copy: case.expand(e, case.shrink(s, copy), copy),
                             self.args.layers, self.args.replays), 3)

    def step_us(self, cases: list[Case], configs: list[tuple[dict, dict]]) -> float:
        """Every projection's pair, layer after layer, in one graph: the step's LoRA microseconds."""
        def layer(copy: int) -> None:
            for case, (s, e) in zip(cases, configs):
                case.expand(e, case.shrink(s, copy), copy)

        return round(time_us(self.args.device, layer, self.args.layers, self.args.replays, per=1), 2)


def _brief(row: dict) -> dict:
    return {"label": row["label"], "us": row["us"], "overrides": row["overrides"], "num_splits": row["num_splits"]}


def _print_form(form: str, summary: dict, layers: int) -> None:
    print(f"\n== {form} ==", flush=True)
    print(f"{'projection':10s} {'kernel':28s} {'default config':34s} {'us':>9s}   {'best config':34s} {'us':>9s}")
    for proj, s in summary["projections"].items():
        print(f"{proj:10s} {s['shrink_kernel']:28s} {s['shrink_default']['label']:34s} "
              f"{s['shrink_default']['us']:9.2f}   {s['shrink_best']['label']:34s} {s['shrink_best']['us']:9.2f}")
        print(f"{'':10s} {s['expand_kernel']:28s} {s['expand_default']['label']:34s} "
              f"{s['expand_default']['us']:9.2f}   {s['expand_best_at_default_splits']['label']:34s} "
              f"{s['expand_best_at_default_splits']['us']:9.2f}")
        best = s["pair_best"]
        default_pair = f"{s['pair_default_sum_us']:.2f}; {s['pair_default_chained_us']:.2f}"
        best_pair = f"{best['sum_us']:.2f}; {best['chained_us']:.2f}"
        print(f"{'':10s} {'pair (sum; chained)':28s} {default_pair:>44s}   {best_pair:>44s}  = "
              f"{best['shrink']['label']} + {best['expand']['label']}")
        if s["errors"]:
            print(f"{'':10s} {s['errors']} configs wrong or failed to launch (the rows with an error in the JSON)")
    step = summary["step"]
    print(f"step (x{layers} layers): sum of kernels {step['default_sum_ms']:.3f} ms default, "
          f"{step['best_sum_ms']:.3f} ms best; chained in one graph {step['default_chained_ms']:.3f} ms default, "
          f"{step['best_chained_ms']:.3f} ms best", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    _prepare_triton(args.device)
    torch.manual_seed(args.seed)
    model_cfg = random_model_config(args.model.removeprefix("random:"))
    args.layers = args.layers or (model_cfg.num_hidden_layers if args.device == "cuda" else 1)
    settings = {key: getattr(args, key) for key in ("device", "model", "rank", "batch", "num_adapters", "num_slots",
                                                    "forms", "projections", "seed")}
    log(f"LoRA decode kernels of {args.model}, rank {args.rank}, pool of {args.num_slots} slots: forms {args.forms}, "
        f"{args.layers} launches a graph")
    if args.jobs:
        groups = compile_groups(build_cases(settings, copies=1), {k: getattr(args, k) for k in GPU_GRID})
        precompile(settings, groups, args.jobs, 0.6 * args.time_budget)
    cases = build_cases(settings, copies=args.layers)
    sweep = Sweep(args, cases, started)
    result: dict[str, Any] = {
        "settings": {**settings, "layers": args.layers, "replays": args.replays, "grid": sweep.grid,
                     "time_budget_s": args.time_budget},
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)",
        "forms": {}, "rows": sweep.rows,
    }
    try:
        for form in args.forms:
            form_cases = [cases[form, p] for p in args.projections]
            summary: dict[str, Any] = {"batch": form_cases[0].form.batch, "adapters": form_cases[0].form.adapters,
                                       "projections": {}}
            result["forms"][form] = summary
            for case in form_cases:
                summary["projections"][case.proj.name] = sweep.projection(case)
            projs = summary["projections"].values()
            defaults = [({}, {}) for _ in form_cases]
            bests = [(p["pair_best"]["shrink"]["overrides"], p["pair_best"]["expand"]["overrides"]) for p in projs]
            summary["step"] = {
                "layers": args.layers,
                "default_sum_ms": round(args.layers * sum(p["pair_default_sum_us"] for p in projs) / 1e3, 4),
                "best_sum_ms": round(args.layers * sum(p["pair_best"]["sum_us"] for p in projs) / 1e3, 4),
                "default_chained_ms": round(sweep.step_us(form_cases, defaults) / 1e3, 4),
                "best_chained_ms": round(sweep.step_us(form_cases, bests) / 1e3, 4),
            }
            adapters = f"{summary['adapters']} adapter" + ("s" if summary["adapters"] > 1 else "")
            _print_form(f"{form}: batch {summary['batch']} over {adapters}, a pool of {args.num_slots} slots, "
                        f"rank {args.rank}, us per launch", summary, args.layers)
            result["elapsed_s"] = round(time.perf_counter() - started, 1)
            result["skipped_for_time"] = sweep.skipped_for_time
            if args.json:  # what a run cut short leaves
                emit_quietly(result, args.json)
    finally:
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        result["skipped_for_time"] = sweep.skipped_for_time
        if args.json:
            emit_quietly(result, args.json)
    log(f"{len(sweep.rows)} rows in {result['elapsed_s']} s; {sweep.skipped_for_time} configs skipped for time")
    if args.json:
        log(f"wrote {args.json}")
    return result


def emit_quietly(result: dict, path: str) -> None:
    """bench.common.emit without the echo on stdout (the rows are many): the file only."""
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        emit(result, path)


if __name__ == "__main__":
    main()
