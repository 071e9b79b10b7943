"""User settings of the editor: generation parameters and editing defaults, persisted as a small JSON file.

The file is `$XDG_CONFIG_HOME/dcanvas/tui.json` (`~/.config/dcanvas/tui.json` when the variable is unset). It is
untrusted input, so it is parsed with pydantic: unknown keys are dropped, a bad value makes `load_settings` fall
back to the defaults and report why (the editor shows it; it never fails to start over its settings). The
generation fields mirror `canvas.protocol.GenParams` with the same bounds and defaults (a sampler field left empty
takes the model's own default, which the server fills in and echoes; so does the mode).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from canvas.protocol import GenParams, describe_error
from canvas.sampling.modes import mode_label

CONFIG_NAME = "tui.json"


class Settings(BaseModel):
    model_config = ConfigDict(extra="ignore", validate_assignment=True)

    mode: Literal["diffusion", "ar"] | None = None
    """None: the model's default mode for the request (infill or continuation; the server resolves it); "diffusion":
    the diffusion decoder (untrained for denoising on the converted model); "ar": left to right, suffix-aware."""
    max_steps: Annotated[int, Field(ge=1, le=256)] | None = None
    """Most denoising steps of one generation (None: the model's default)."""
    entropy_bound: Annotated[float, Field(gt=0, le=1e6)] | None = None
    """Entropy budget per step: higher accepts more tokens per step (faster, less careful). None: the model's."""
    t_max: Annotated[float, Field(ge=0, le=100)] | None = None
    """Temperature at the first step (None: the model's default)."""
    t_min: Annotated[float, Field(gt=0, le=100)] | None = None
    """Temperature at the last step (None: the model's default)."""
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    """Fixed seed for reproducible runs; None lets the server pick (regenerate always picks a new one)."""
    gap_tokens: Annotated[int, Field(ge=1, le=256)] = 16
    """Tokens in a new gap (insert gap, or generate with nothing masked)."""

    @model_validator(mode="after")
    def _temperatures(self) -> Settings:
        if self.t_max is not None and self.t_min is not None and self.t_max < self.t_min:
            raise ValueError(f"t_max ({self.t_max}) must be >= t_min ({self.t_min})")
        return self

    def gen_params(self, seed: int | None = None) -> GenParams:
        """The `gen.start` params; `seed` overrides the configured one (regenerate)."""
        return GenParams(
            mode=self.mode,
            max_steps=self.max_steps,
            entropy_bound=self.entropy_bound,
            t_max=self.t_max,
            t_min=self.t_min,
            seed=self.seed if seed is None else seed,
        )


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dcanvas" / CONFIG_NAME


def load_settings(path: Path | None = None) -> tuple[Settings, str | None]:
    """The saved settings (defaults when there is no file) and, when the file was unusable, why."""
    p = path or config_path()
    try:
        raw = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Settings(), None
    except OSError as e:
        return Settings(), f"cannot read {p}: {e.strerror or e}; using the default settings"
    try:
        return Settings.model_validate(json.loads(raw)), None
    except ValidationError as e:
        return Settings(), f"{p}: {describe_error(e)}; using the default settings"
    except ValueError as e:
        return Settings(), f"{p} is not valid JSON ({e}); using the default settings"


def save_settings(settings: Settings, path: Path | None = None) -> Path:
    """Write the settings atomically; raises OSError when the directory cannot be written."""
    p = path or config_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tui.", suffix=".json", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(settings.model_dump_json(indent=2) + "\n")
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


# The mode setting's choices, in the settings form's order. Their labels, and those of what a run wrote, are
# `canvas.sampling.modes.mode_label`'s (re-exported here): one table for the editor, the web page and the CLI.
MODE_CHOICES: tuple[str | None, ...] = (None, "diffusion", "ar")


def setting_label(mode: str | None) -> str:
    """How the settings form names a mode setting: AR covers both of what it runs (left to right for a
    continuation, K drafts scored by the seam for an infill)."""
    if mode == "ar":
        return f"{mode_label('ar')}; infills: {mode_label('ar', 'infill')}"
    return mode_label(mode)
