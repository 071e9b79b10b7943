"""`dcanvas bench ar`: the AR pathway's speed (the encoder's one-token step), optionally beside llama.cpp.

    dcanvas bench ar [--model DIR | --preset bench-15m] [--dtype auto] [--int8 off|weight|dynamic|q8] [--batch 8]
                     [--compile off|on|both] [--vs-general] [--vs-int8 off|weight|dynamic|q8] [--prompt 256]
                     [--tokens 32] [--runs 5] [--threads N]
                     [--against-llama LLAMA_BENCH [--gguf FILE]]

Owns the AR measurements, all in the dtype the server would pick (`--dtype auto`: `canvas.model.cpu`'s rule):
- prefill: `--prompt` tokens through `DiffusionModel.encode` into a fresh static cache, last position's logits;
- decode at batch 1 and batch `--batch`: `--tokens` greedy steps after that prefix, each one `encode` of (B, 1)
  ids with the cache plus the greedy token draw the engine's AR step runs at temperature 0 (`canvas.engine.ar.draw`:
  the token and its log-probability, no bans);
- the batch-1 step split: layers (projections, norms, MLP, experts, cache writes), attention over the cache (the
  decode step's attention calls alone, at the cache's shapes), head (final norm, LM head, softcap), sampler
  (that draw), and Python / dispatch: the step's wall minus the time spent in operators, i.e. what torch's profiler
  attributes to aten ops plus the wall of the C++ kernels' calls (`kernels._cpp`'s, timed by wrapping their entry
  points: they are pybind calls the profiler does not see); an estimate, the profiler adds a little to both.
  Layers is what remains of `encode(logits="none")` after attention and Python.
With int8 decode weights (`--int8`, default as the server decides: `DCANVAS_DECODE_INT8`, else "auto",
`canvas.model.int8.scheme_for`; fp32 models only) the decode figures are the int8 ones, the same without int8
come beside them, and so does the int8 steps' fidelity: `tokens` decode steps fed fp32's greedy tokens, their
top-1 agreement with fp32, the mean KL(fp32 || int8) and the ratio of the two perplexities of those tokens.
Step variants (`canvas.model.decode`): `--compile on` steps through the `torch.compile`d layer halves (compiled
before timing; the compile's wall time is reported), `off` eagerly, `both` measures the two interleaved run by run
(the ratio is the figure to read on a shared machine) and reports the primary figures for the compiled one;
`--vs-general` adds the general `run_layers` path (what a step ran before the few-op step) to the same rotation,
`--vs-int8 SCHEME` the eager step with another int8 scheme's decode weights (quantised once, swapped per run).
What limits the step: `decode_bytes` counts the bytes one batch-1 step must read (weights, int8 where used, one
expert in K of each layer, every expert when compiled, the head; plus the KV cache after
the prefix), `read_bandwidth` times a sum over a 256 MB tensor (best of 5, this process's threads): bytes over the
step's time, against that, says how near memory speed the step runs.
Every figure is the median of `--runs` runs. `--against-llama PATH` runs that `llama-bench` binary on the GGUF of
the same weights (`--gguf`, default: the Q4_K_M file `dcanvas model build` joined into its cache) at the same
thread count and prompt, in the same run, and prints our / its tok/s; where `llama-batched-bench` was built beside
it, also its batch-`--batch` step over its batch-1 step on as many distinct sequences (`canvas.bench.llama`).
llama.cpp is only a yardstick: never a dependency; its head is Gemma 3's full vocabulary, ours the model directory's.
The last line is one JSON object with the machine (CPU kind, flags, torch, git sha); figures from a shared machine
read high.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from canvas.bench.llama import BATCHED, LlamaBenchError, default_gguf, llama_batched, llama_bench
from canvas.engine.ar import draw
from canvas.model import PRESETS, DiffusionModel, KVCache, ModelConfig, load_pretrained
from canvas.model.cpu import configure_allocator, configure_threads, dtype_name, parameter_count, resolve_dtype
from canvas.model.decode import DecodeCompiler, attend_one, compile_setting
from canvas.model.int8 import SCHEMES, DecodeCopies, Scheme, decode_copies, quantize_decode, restore_decode, scheme_for
from canvas.model.io import read_config
from canvas.sampling.modes import load_mode_defaults
from canvas.sampling.sampler import SamplerConfig

_GREEDY = SamplerConfig()  # temperature 0 reads none of its truncation settings
SPLIT = ("layers", "attention", "head", "sampler", "python")


@dataclass(frozen=True, slots=True)
class ArShape:
    prompt: int  # prefix tokens (prefill length)
    tokens: int  # decode steps a run
    batch: int  # rows of the batched decode
    runs: int

    def __post_init__(self) -> None:
        for name in ("prompt", "tokens", "batch", "runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _wall_s(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median_s(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up: first-call packing, allocator, thread pool
    return statistics.median(_wall_s(fn) for _ in range(runs))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The engine's greedy draw of one token a row from logits (B, V), without bans -> (B, 1)."""
    tok, _ = draw(logits, [[]] * logits.shape[0], 0.0, _GREEDY, None)
    return tok[:, None]


def _prefix(model: DiffusionModel, shape: ArShape, batch: int) -> tuple[torch.Tensor, KVCache]:
    """A prefilled cache of `batch` rows with room for the decode steps, and the first tokens to feed (B, 1)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (batch, shape.prompt), generator=g)
    logits, cache = model.encode(prompt, cache=model.new_cache(batch, shape.prompt + shape.tokens + 1), logits="last")
    assert logits is not None
    return logits[:, -1].argmax(-1, keepdim=True), cache


def decode_s(model: DiffusionModel, shape: ArShape, batch: int) -> float:
    """Median seconds of one greedy decode step of `batch` rows (each run: `tokens` steps on a fresh copy of the
    prefilled cache), the model's step as it is set."""
    return decode_variants_s(model, shape, batch, {"step": lambda: None})["step"]


def decode_variants_s(model: DiffusionModel, shape: ArShape, batch: int,
                      variants: dict[str, Callable[[], object]]) -> dict[str, float]:
    """`decode_s` of each variant (name -> a function that sets the model up for it), interleaved: run i of every
    variant before run i + 1 of any, so load on a shared machine falls on all of them alike. Leaves the model set
    up as the last variant."""
    first, template = _prefix(model, shape, batch)

    def run() -> float:
        cache = template.grown(template.capacity)  # a private copy: every run decodes after the same prefix
        tok = first
        t0 = time.perf_counter()
        for _ in range(shape.tokens):
            logits, _ = model.encode(tok, cache=cache, logits="last")
            assert logits is not None
            tok = greedy(logits[:, -1])  # (B, 1)
        return (time.perf_counter() - t0) / shape.tokens

    times: dict[str, list[float]] = {name: [] for name in variants}
    for setup in variants.values():
        setup()
        run()  # warm-up
    for _ in range(shape.runs):
        for name, setup in variants.items():
            setup()
            times[name].append(run())
    return {name: statistics.median(t) for name, t in times.items()}


def prefill_s(model: DiffusionModel, shape: ArShape) -> float:
    prompt = torch.randint(3, model.config.vocab_size, (1, shape.prompt), generator=torch.Generator().manual_seed(1))
    return _median_s(lambda: model.encode(prompt, cache=model.new_cache(1, shape.prompt + 1), logits="last"),
                     shape.runs)


@contextmanager
def _timed_kernels() -> Iterator[list[float]]:
    """While open, the C++ kernels' entry points (as the decode step and the head look them up) add their wall
    time to the yielded cell: they are pybind calls, which torch's profiler does not count as operators."""
    from canvas.model import decode, int8
    from kernels import act_cpu

    spent = [0.0]

    def timed(get: Callable[[], Any]) -> Callable[[], Any]:
        fn = get()
        if fn is None:
            return get

        def call(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args)
            spent[0] += time.perf_counter() - t0
            return out

        return lambda: call

    targets = [(decode, "_fused_norm_kernel"), (decode, "_attend_cpu_kernel"), (decode, "_gelu_mul_kernel"),
               (int8, "_q8_kernel"), (act_cpu, "softcap_kernel")]
    saved = [(mod, name, getattr(mod, name)) for mod, name in targets]
    try:
        for mod, name, get in saved:
            setattr(mod, name, timed(get))
        yield spent
    finally:
        for mod, name, get in saved:
            setattr(mod, name, get)


def _operator_s(fn: Callable[[], object]) -> float:
    """Seconds spent in operators during one call of `fn`: torch's profiler's self time of every aten op, plus the
    C++ kernels' calls (`_timed_kernels`)."""
    from torch.profiler import ProfilerActivity, profile

    with _timed_kernels() as spent, profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::")) / 1e6 + spent[0]


def step_split(model: DiffusionModel, shape: ArShape) -> dict[str, float]:
    """Seconds of one batch-1 step by part (`SPLIT`; see the module docstring for how each is taken)."""
    first, template = _prefix(model, shape, 1)
    cfg = model.config
    steps = shape.tokens

    def encode_steps(cache: KVCache) -> Callable[[], object]:
        return lambda: [model.encode(first, cache=cache, logits="none") for _ in range(steps)]

    # The encoder's body alone, and the operators' share of it, each over `tokens` steps on a fresh cache copy.
    encode_steps(template.grown(template.capacity))()  # warm-up
    body = statistics.median(_wall_s(encode_steps(template.grown(template.capacity))) / steps
                             for _ in range(shape.runs))
    ops = statistics.median(_operator_s(encode_steps(template.grown(template.capacity))) / steps
                            for _ in range(max(1, shape.runs // 2)))
    # Attention over the cache: each layer's one query over its cached keys, as the decode step attends
    # (`canvas.model.decode`: the C++ kernel for fp32 on the CPU, else two matmuls and a softmax).
    g = torch.Generator().manual_seed(2)
    calls = []
    for i, layer in enumerate(model.blocks):
        keys, values = template.read(i)
        q = torch.randn(1, layer.attn.n_heads, 1, layer.attn.head_dim, generator=g).to(model.dtype)
        calls.append((q, keys, values))

    def attention() -> None:
        for q, k, v in calls:
            attend_one(q, k, v, None)

    h = torch.randn(1, 1, cfg.hidden_size, generator=g).to(model.dtype)
    quant = model.decode_int8 is not None  # one row: `encode` takes the int8 head when the model has one
    logits = model.logits(h, quant)[:, -1]  # (1, V)
    parts = {
        "attention": _median_s(attention, shape.runs),
        "head": _median_s(lambda: model.logits(h, quant), shape.runs),
        "sampler": _median_s(lambda: greedy(logits), shape.runs),
        "python": max(0.0, body - ops),
    }
    parts["layers"] = max(0.0, body - parts["attention"] - parts["python"])
    return {k: parts[k] for k in SPLIT}


def _teacher_forced(model: DiffusionModel, first: torch.Tensor, template: KVCache, tokens: torch.Tensor | None,
                    steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (steps, V) of `steps` decode steps after the prefix, fed `tokens` (steps,) or, when None,
    the greedy ones; and the tokens fed."""
    cache = template.grown(template.capacity)
    tok, fed, out = first, [], []
    for i in range(steps):
        if tokens is not None:
            tok = tokens[i].view(1, 1)
        fed.append(tok.view(()))
        logits, _ = model.encode(tok, cache=cache, logits="last")
        assert logits is not None
        out.append(torch.log_softmax(logits[0, -1], dim=-1))
        tok = logits[:, -1].argmax(-1, keepdim=True)
    return torch.stack(out), torch.stack(fed)


def int8_fidelity(model: DiffusionModel, scheme: Scheme, shape: ArShape) -> dict[str, float]:
    """int8 decode steps against the model's own dtype on the same prefix and tokens (fp32's greedy ones): top-1
    agreement, mean KL(fp32 || int8) in nats, and int8's perplexity of the next fed token over fp32's. Leaves the
    model with the int8 weights of `scheme`."""
    quantize_decode(model, None)
    first, template = _prefix(model, shape, 1)
    ref, fed = _teacher_forced(model, first, template, None, shape.tokens)
    quantize_decode(model, scheme)
    got, _ = _teacher_forced(model, first, template, fed, shape.tokens)
    nxt = fed[1:]  # the token each step predicted next, as fed (the last step's successor was never fed)
    nll = [-lp[:-1].gather(1, nxt[:, None]).mean() for lp in (ref, got)]
    return {"top1_agree": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
            "kl": float((ref.exp() * (ref - got)).sum(-1).mean()),
            "ppl_ratio": float(torch.exp(nll[1] - nll[0])) if len(nxt) else 1.0}


def decode_bytes(model: DiffusionModel, cache: KVCache) -> tuple[int, int]:
    """(weight bytes, KV cache bytes) one batch-1 decode step reads: every layer's parameters (only top-k of its
    experts on the general path), int8 copies in place of the projections that have them, the final norm and the
    LM head; the cached keys and values each layer attends over (`cache`: one row)."""
    weights = 0
    for layer in model.blocks:
        for name, p in layer.named_parameters():
            n = p.numel() * p.element_size()
            # The compiled step runs every expert (canvas.model.decode); the eager ones read the top-k only.
            dense = model.decode_fast and model.decode_compile is not None
            weights += n * layer.top_k // p.shape[0] if name.startswith("experts_") and not dense else n
        for w, q in ((layer.attn.qkv, layer.attn.qkv_int8), (layer.attn.o_proj, layer.attn.o_proj_int8),
                     (layer.mlp_gate_up, layer.mlp_gate_up_int8), (layer.mlp_down, layer.mlp_down_int8)):
            if q is not None:
                weights += w.numel() - w.numel() * w.element_size()  # 1 byte a weight instead
    head = model.embed.numel()
    weights += head if model.head_int8 is not None else head * model.embed.element_size()
    weights += model.norm.numel() * model.norm.element_size()
    kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
             for k, v in (cache.read(i) for i in range(len(cache.layers))))
    return weights, kv


# The x86 features that decide which int8 and bf16 kernels a CPU runs natively (canvas.model.cpu reads only the
# ones that pick the dtype): beside every figure, so an AVX-512 VNNI box is not mistaken for an AVX2-only one.
_SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")


def simd_flags() -> list[str]:
    """Which of `_SIMD_FLAGS` /proc/cpuinfo reports (empty where it is unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f for f in _SIMD_FLAGS if f in flags]


def read_bandwidth() -> float:
    """Bytes a second this process reads from memory: a sum over 256 MB of fp32 (written first, so no page is the
    shared zero page), best of 5."""
    a = torch.ones(64 << 20)
    return a.numel() * a.element_size() / min(_wall_s(a.sum) for _ in range(5))


# ---- the command ----------------------------------------------------------------------------------------------------
def _model(args: argparse.Namespace) -> DiffusionModel:
    if args.model is not None:
        path = Path(args.model)
        dtype = resolve_dtype(args.dtype, params=parameter_count(read_config(path)),
                              decodes=load_mode_defaults(path).decodes)
        return load_pretrained(path, dtype=dtype)
    cfg = ModelConfig.from_name(args.preset)
    dtype = resolve_dtype(args.dtype, params=parameter_count(cfg))
    torch.manual_seed(0)
    return DiffusionModel(cfg).to(dtype).eval()


def _step_variants(model: DiffusionModel, compile_: str, vs_general: bool, vs_int8: str | None,
                   copies: dict[str, DecodeCopies]) -> dict[str, Callable[[], object]]:
    """name -> a function setting the model's decode step up that way; the primary (reported) variant last.
    `copies`: the int8 copies each variant uses ("primary"; "alt" for the `vs_int8` variant), filled by the caller
    before the first timing."""
    compiler = DecodeCompiler() if compile_ in ("on", "both") else None

    def use(fast: bool, comp: DecodeCompiler | None, which: str = "primary") -> Callable[[], object]:
        def setup() -> None:
            model.decode_fast, model.decode_compile = fast, comp
            if which in copies:
                restore_decode(model, copies[which])
        return setup

    variants: dict[str, Callable[[], object]] = {}
    if vs_general:
        variants["general"] = use(False, None)
    if vs_int8 is not None:
        variants[f"int8 {vs_int8}"] = use(True, None, "alt")
    if compile_ in ("off", "both"):
        variants["eager"] = use(True, None)
    if compiler is not None:
        variants["compiled"] = use(True, compiler)
    return variants


def bench_ar(args: argparse.Namespace) -> dict[str, Any]:
    from canvas.bench.common import machine, print_table

    shape = ArShape(args.prompt, args.tokens, args.batch, args.runs)
    if args.compile is None:
        args.compile = "on" if compile_setting() else "off"
    model = _model(args)
    cfg = model.config
    scheme = scheme_for(model, args.int8)  # as the server decides: int8 decode weights serve fp32 models only
    extra_rows: list[tuple[str, str]] = []
    copies: dict[str, DecodeCopies] = {}
    vs_int8 = None if args.vs_int8 is None else scheme_for(model, args.vs_int8) or "off"
    variants = _step_variants(model, args.compile, args.vs_general, vs_int8, copies)
    primary = next(reversed(variants))
    variants[primary]()
    compiler = model.decode_compile
    compile_s = None
    if compiler is not None:  # compile before any timing (and time it): the first call of a fresh process
        compiler.stance = "default"  # recompile for the int8 / fp32 variants below (a server falls back instead)
        t0 = time.perf_counter()
        compiler.warm(model, (1, shape.batch) if shape.batch > 1 else (1,))
        if compiler.error is not None:
            raise SystemExit(f"bench ar: torch.compile failed: {compiler.error}")
        compile_s = time.perf_counter() - t0
    without: dict[str, float] = {}
    if scheme is not None:
        without = {"decode_b1_step_ms": decode_s(model, shape, 1) * 1e3,
                   f"decode_b{shape.batch}_step_ms": decode_s(model, shape, shape.batch) * 1e3,
                   "prefill_ms": prefill_s(model, shape) * 1e3}  # "q8" serves prefill too (int8.ROW_LIMITS)
        fidelity = int8_fidelity(model, scheme, shape)  # leaves the int8 weights in place
        extra_rows = [
            (f"without int8: batch 1 / batch {shape.batch} step ms",
             f"{without['decode_b1_step_ms']:.1f} / {without[f'decode_b{shape.batch}_step_ms']:.1f}"),
            (f"without int8: prefill {shape.prompt} tokens, tok/s",
             f"{shape.prompt / without['prefill_ms'] * 1e3:.0f}"),
            ("int8 vs fp32 steps: top-1 / KL nats / ppl ratio",
             f"{fidelity['top1_agree']:.3f} / {fidelity['kl']:.4f} / {fidelity['ppl_ratio']:.3f}"),
        ]
    if vs_int8 is not None:  # the other scheme's copies, quantised once, swapped in for its runs
        copies["primary"] = decode_copies(model)
        quantize_decode(model, None if vs_int8 == "off" else vs_int8)
        copies["alt"] = decode_copies(model)
        restore_decode(model, copies["primary"])
    per_b1 = decode_variants_s(model, shape, 1, variants)
    per_bk = decode_variants_s(model, shape, shape.batch, variants)  # leaves the primary variant set up
    b1, bk = per_b1[primary], per_bk[primary]
    if len(variants) > 1:
        for name in variants:
            if name != primary:
                extra_rows.append((f"{name} step: batch 1 / batch {shape.batch} ms ({primary} speed-up)",
                                   f"{per_b1[name] * 1e3:.1f} / {per_bk[name] * 1e3:.1f} "
                                   f"({per_b1[name] / b1:.2f}x / {per_bk[name] / bk:.2f}x)"))
    if compile_s is not None:
        extra_rows.append(("torch.compile warm-up (batch 1 and batch K graphs), s", f"{compile_s:.1f}"))
    pre = prefill_s(model, shape)
    split = step_split(model, shape)
    weight_bytes, kv_bytes = decode_bytes(model, _prefix(model, shape, 1)[1])
    bandwidth = read_bandwidth()
    out: dict[str, Any] = {
        "model": str(args.model) if args.model is not None else cfg.name, "dtype": dtype_name(model.dtype),
        "decode_int8": scheme, "step": primary, "compile_s": compile_s,
        "variants": {name: {"decode_b1_step_ms": per_b1[name] * 1e3,
                            f"decode_b{shape.batch}_step_ms": per_bk[name] * 1e3} for name in variants},
        "vocab": cfg.vocab_size, "prompt": shape.prompt, "tokens": shape.tokens,
        "batch": shape.batch, "runs": shape.runs,
        "decode_b1_tok_s": 1 / b1, "decode_b1_step_ms": b1 * 1e3,
        f"decode_b{shape.batch}_tok_s": shape.batch / bk, f"decode_b{shape.batch}_step_ms": bk * 1e3,
        "batch_step_vs_b1": bk / b1, "prefill_tok_s": shape.prompt / pre, "prefill_ms": pre * 1e3,
        "split_ms": {k: v * 1e3 for k, v in split.items()},
        "step_weight_mb": weight_bytes / 1e6, "step_kv_mb": kv_bytes / 1e6,
        "step_gb_s": (weight_bytes + kv_bytes) / b1 / 1e9, "read_bandwidth_gb_s": bandwidth / 1e9,
    }
    if scheme is not None:
        out["without_int8"] = without
        out["int8_fidelity"] = fidelity
    rows = [
        ("model / dtype / int8 decode / vocab / step",
         f"{out['model']} / {out['dtype']} / {scheme or 'off'} / {cfg.vocab_size} / {primary}"),
        ("decode batch 1, tok/s (step ms)", f"{1 / b1:.1f} ({b1 * 1e3:.1f})"),
        (f"decode batch {shape.batch}, tok/s (step ms)", f"{shape.batch / bk:.1f} ({bk * 1e3:.1f})"),
        (f"batch-{shape.batch} step / batch-1 step (goal <= 1.2)", f"{bk / b1:.2f}"),
        (f"prefill {shape.prompt} tokens, tok/s", f"{shape.prompt / pre:.0f}"),
        *[(f"batch-1 step: {k}, ms", f"{v * 1e3:.2f}") for k, v in split.items()],
        ("batch-1 step reads: weights + KV cache, MB", f"{weight_bytes / 1e6:.0f} + {kv_bytes / 1e6:.1f}"),
        ("step GB/s / this machine's read GB/s", f"{out['step_gb_s']:.1f} / {bandwidth / 1e9:.1f}"),
        *extra_rows,
    ]
    if args.against_llama is not None:
        gguf = args.gguf if args.gguf is not None else default_gguf()
        if gguf is None:
            raise LlamaBenchError("no GGUF given (--gguf) and none in the dcanvas cache (dcanvas model build)")
        llama = llama_bench(Path(args.against_llama), Path(gguf), prompt=shape.prompt, tokens=shape.tokens,
                            threads=torch.get_num_threads(), runs=shape.runs)
        llama["decode_ratio"] = out["decode_b1_tok_s"] / llama["decode_tok_s"]
        llama["prefill_ratio"] = out["prefill_tok_s"] / llama["prefill_tok_s"]
        # Its batch ratio, where llama-batched-bench was built beside llama-bench: the same B distinct sequences.
        beside = Path(llama["command"][0]).with_name(BATCHED)
        llama["batched"] = (llama_batched(beside, Path(gguf), prompt=shape.prompt, tokens=shape.tokens,
                                          batch=shape.batch, threads=torch.get_num_threads())
                            if beside.is_file() else None)
        out["llama"] = llama
        rows += [
            ("llama.cpp decode batch 1, tok/s", f"{llama['decode_tok_s']:.1f} ({llama['model_type']})"),
            ("ours / llama.cpp decode (goal >= 1)", f"{llama['decode_ratio']:.2f}"),
            (f"llama.cpp prefill {shape.prompt}, tok/s", f"{llama['prefill_tok_s']:.0f}"),
            ("ours / llama.cpp prefill (goal >= 1.5)", f"{llama['prefill_ratio']:.2f}"),
        ]
        batched = llama["batched"]
        rows.append((f"llama.cpp batch-{shape.batch} step / batch-1 step (ms)",
                     f"{batched['ratio']:.2f} ({batched['batch_step_ms']:.1f} / {batched['b1_step_ms']:.1f})"
                     if batched is not None else f"not run: no {BATCHED} beside llama-bench"))
    out["machine"] = {**machine(), "simd": simd_flags()}
    print_table(f"AR decoding, {out['model']}, {out['dtype']}, {torch.get_num_threads()} threads "
                f"(median of {shape.runs}; CPU {', '.join(out['machine']['simd']) or out['machine']['cpu_kind']})",
                rows)
    return out


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="a model directory (else --preset, random weights)")
    parser.add_argument("--preset", default="bench-15m", choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                        help="auto: what the server would pick on this CPU")
    parser.add_argument("--int8", choices=("auto", "off", *SCHEMES), default=None,
                        help="int8 decode weights (default: $DCANVAS_DECODE_INT8, else auto, as the server: weight "
                             "for fp32 models of 50M parameters or more; fp32 models only)")
    parser.add_argument("--batch", type=int, default=8, help="rows of the batched decode")
    parser.add_argument("--compile", choices=("off", "on", "both"), default=None,
                        help="the decode step through torch.compile: off (eager), on, or both interleaved (default: "
                             "$DCANVAS_DECODE_COMPILE, as the server)")
    parser.add_argument("--vs-general", action="store_true",
                        help="also time the general run_layers path (the step before the few-op one), interleaved")
    parser.add_argument("--vs-int8", choices=("off", *SCHEMES), default=None,
                        help="also time the eager step with this int8 scheme's decode weights, interleaved")
    parser.add_argument("--prompt", type=int, default=256, help="prefix tokens (prefill)")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps a run")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: the usable cores)")
    parser.add_argument("--against-llama", metavar="LLAMA_BENCH", default=None,
                        help="a llama.cpp llama-bench binary to run on the same weights' GGUF (and the "
                             "llama-batched-bench beside it, when built)")
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF for --against-llama")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    configure_threads(args.threads or None)  # as the server does: the usable cores unless told
    configure_allocator()
    try:
        out = bench_ar(args)
    except LlamaBenchError as e:
        raise SystemExit(f"bench ar: {e}") from None
    print(json.dumps(out))
    return 0


__all__ = ["ArShape", "bench_ar", "decode_s", "greedy", "prefill_s", "register", "step_split"]
