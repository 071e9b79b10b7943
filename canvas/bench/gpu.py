"""`dcanvas bench model --gpu`: the 26B-A4B text shapes with random bf16 weights, ours vs transformers, on CUDA.

Builds the transformers reference at the published text shapes with `--layers N` and `2N` layers (the full 30 do
not fit a short GPU check together with the reference), copies its weights into our model, and times one
denoising step (decoder forward with self-conditioning + sampler) for one 256-token canvas at batch 1 after a
1024-token prompt. Step time is linear in the layer count, t = a + b * layers: two sizes give a and b, and the
30-layer figure is extrapolated from them, stated as such. Reported: decode tok/s for one canvas at vLLM's fixed 16
steps (256 / (16 * t)), ours and the reference; the anchor is vLLM's 1,757 decode tok/s on one H100 (FP8).
On a machine without CUDA it runs the same code at the `tiny` preset on the CPU (a smoke test, not a figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any, cast

import torch

from canvas.model import PRESETS, ModelConfig, load_state_dict_hf
from canvas.model.config import FULL, SLIDING, LayerType

VLLM_H100_FP8_TOK_S = 1757.0
FIXED_STEPS = 16


def _reference(cfg: ModelConfig, device: str, dtype: torch.dtype) -> Any:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    hf = cfg.to_hf_dict()
    config = DiffusionGemmaConfig(text_config=hf["text_config"], vision_config=hf["vision_config"],
                                  canvas_length=cfg.canvas_length)
    with torch.device(device):
        ref = cast(Any, DiffusionGemmaForBlockDiffusion(config)).to(dtype).eval()
    return ref


def _time(fn: Any, runs: int, device: str) -> float:
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step_times(cfg: ModelConfig, prompt_len: int, runs: int, device: str, dtype: torch.dtype) -> dict[str, float]:
    from transformers import DynamicCache

    from canvas.sampling.sampler import GumbelNoise, select_accepted, step_stats

    ref = _reference(cfg, device, dtype)
    ours = load_state_dict_hf(cfg, ref.state_dict(), device=device, dtype=dtype)
    V, L = cfg.vocab_size, cfg.canvas_length
    prompt = torch.randint(3, V, (1, prompt_len), device=device)
    canvas = torch.randint(0, V, (1, L), device=device)
    _, cache = ours.encode(prompt, logits="none")
    ref_cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
    with torch.no_grad():
        ref.model.encoder(input_ids=prompt, past_key_values=ref_cache)
    noise = GumbelNoise(0)
    free = torch.ones(1, L, dtype=torch.bool, device=device)
    state: dict[str, Any] = {"soft": None, "sc": None}

    def ours_step() -> None:
        logits = ours.denoise(canvas, cache, soft_embeddings=state["soft"])
        processed = logits.div_(0.6)
        stats = step_stats(processed, noise)
        select_accepted(stats.entropy, free, 0.1)
        state["soft"] = ours.soft_embeddings(processed)

    def ref_step() -> None:
        with torch.no_grad():
            logits = ref(decoder_input_ids=canvas, past_key_values=ref_cache,
                         self_conditioning_logits=state["sc"]).logits
            processed = logits / 0.6
            probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
            torch.multinomial(probs.view(-1, V), 1)
            torch.distributions.Categorical(logits=processed).entropy()
            state["sc"] = processed

    ours_step()
    ref_step()
    return {"ours": _time(ours_step, runs, device), "reference": _time(ref_step, runs, device)}


def bench_model_gpu(args: argparse.Namespace) -> dict[str, Any]:
    from canvas.bench.common import machine, print_table

    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    base = PRESETS["26b-a4b"] if on_gpu else PRESETS["tiny"]
    n = max(1, args.layers)
    sizes = (n, 2 * n)
    times = {}
    for layers in sizes:
        # Keep the reference's 5:1 sliding:full pattern, last layer full.
        types: tuple[LayerType, ...] = tuple(SLIDING if (i + 1) % 6 and i != layers - 1 else FULL
                                             for i in range(layers))
        cfg = dataclasses.replace(base, num_hidden_layers=layers, layer_types=types)
        times[layers] = _step_times(cfg, 1024 if on_gpu else 32, args.runs, device, dtype)
        if on_gpu:
            torch.cuda.empty_cache()  # the first size's models are gone with _step_times' frame
    full_layers = base.num_hidden_layers
    result: dict[str, Any] = {"device": device, "dtype": str(dtype), "measured_layers": list(sizes),
                              "extrapolated_to_layers": full_layers, "machine": machine()}
    rows = []
    for who in ("ours", "reference"):
        t1, t2 = times[sizes[0]][who], times[sizes[1]][who]
        # Least-squares line through two points, held to non-negative cost: timing noise can make the larger
        # model look faster, and then the layer cost is taken as the whole step spread over the layers.
        per_layer = (t2 - t1) / (sizes[1] - sizes[0])
        if per_layer <= 0:
            per_layer, fixed = t2 / sizes[1], 0.0
        else:
            fixed = max(t1 - per_layer * sizes[0], 0.0)
        t_full = fixed + per_layer * full_layers
        tok_s = base.canvas_length / (FIXED_STEPS * t_full)
        result[who] = {"step_ms": {str(k): v[who] * 1e3 for k, v in times.items()},
                       "step_ms_extrapolated": t_full * 1e3, "decode_tok_s_16_steps": tok_s}
        rows.append((f"{who}: step ms at {sizes} layers", " / ".join(f"{times[k][who] * 1e3:.2f}" for k in sizes)))
        rows.append((f"{who}: {full_layers}-layer step ms (extrapolated)", f"{t_full * 1e3:.2f}"))
        rows.append((f"{who}: decode tok/s, 16 steps", f"{tok_s:.0f}"))
    result["speedup"] = result["reference"]["step_ms_extrapolated"] / result["ours"]["step_ms_extrapolated"]
    result["vs_vllm_h100_fp8"] = result["ours"]["decode_tok_s_16_steps"] / VLLM_H100_FP8_TOK_S
    rows.append(("speedup vs transformers", f"{result['speedup']:.2f}x"))
    rows.append(("ours / vLLM 1,757 tok/s (H100, FP8)", f"{result['vs_vllm_h100_fp8']:.2f}"))
    if not on_gpu:
        rows.append(("note", "no CUDA: tiny preset on CPU, a smoke test only"))
    print_table(f"model step, {'26B-A4B shapes, random bf16' if on_gpu else 'tiny (CPU smoke)'}", rows)
    return result
