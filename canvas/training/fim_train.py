"""`dcanvas train --objective fim`: the FIM fine-tune of the converted Gemma, resumable bit for bit, on a CPU.

What trains: low-rank adapters (`canvas.training.adapt.LoRA`) on `targets` of the converted layers (the appended
identity layer and everything else stay frozen; `LowRankWeight` runs them beside the frozen matrix, never forming a
full weight gradient) and the four FIM sentinels' embedding rows (`SentinelRows`, a small
parameter of its own: the frozen embedding never gets a gradient; the tied head reads the rows too). The loss is
next-token cross-entropy at the positions `canvas.training.fim` marks (a FIM piece's middle and `<end>`, a plain
piece's text), the head run only on those positions' hidden states (gathered first). With `plain_anchor` = w > 0
a plain target's loss is (1 - w) CE + w KL(base || adapted): the frozen base's next-token distribution (the same
model with the adapters switched off and the sentinel rows unused, under no_grad, on the plain pieces only) is the
soft target, so plain text pulls the adapters back toward the base instead of toward the corpus's style; FIM targets
keep the hard CE (the format has no base distribution to keep).

A run lives in one directory: `train_config.json`, `checkpoint.pt` (adapters, sentinel rows, optimizer, step and
tokens, loss history; nothing else is needed to resume: rows and LoRA init are functions of the seed and step),
written atomically with the previous one kept, and `loss.csv` / `loss.json`. Each logged evaluation reports the
held-out FIM loss (fixed FIM-only rows of the validation split) and the held-out plain loss (fixed plain rows),
`plain_ppl_ratio`, exp of the plain loss's change since step 0 (the base's), which must stay within 1.02, and
`valid_plain_kl`, the KL from the anchor's teacher on those plain rows (with the base as teacher 0 at step 0: the
drift itself; with the original Gemma 3, what the conversion and the trimming cost, which training should lower).
`export_fim_adapters` writes the set `dcanvas model build` merges (`canvas.convert.adapters.apply_fim_adapters`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from canvas.convert.adapters import META, SENTINEL_ROWS, WEIGHTS, param_owner
from canvas.convert.fim import SENTINELS, recorded_fim_adapters
from canvas.engine import decoder_weights as low_rank
from canvas.model import DiffusionModel
from canvas.training.adapt import LoRA
from canvas.training.fim import FIM, NONE, PLAIN, Corpus, FimDataConfig, Rows, attention_mask, sample_rows
from canvas.training.train import save_checkpoint, write_curve

# Attention (reading the suffix across the sentinels is attention's work) and the MLP's output projection (a write
# path into the residual stream); the MLP's gate/up, the largest matrix (4096 x 640), is left out: rank 8 on it
# would double the checkpoint for what the literature finds a small gain.
DEFAULT_TARGETS = ("attn.qkv", "attn.o_proj", "mlp_down")
TRAIN_STREAM, VALID_FIM_STREAM, VALID_PLAIN_STREAM, VALID_CODE_FIM_STREAM, VALID_CODE_STREAM = 0, 1, 2, 3, 4
_LORA = "_lora"  # the adapter of matrix `m` is the submodule `m_lora` beside it
# Plain targets' share of the loss taken as KL from the base rather than CE on the corpus (see `FimTrainConfig`).
DEFAULT_PLAIN_ANCHOR = 0.8


@dataclass(frozen=True, slots=True)
class FimTrainConfig:
    base: str  # the converted model directory (`dcanvas model build`); its tokenizer tokenizes the corpus
    # The corpus tokenized with the base's tokenizer (made on the first start); "" follows the base: `fim_tokens_dir`.
    tokens_dir: str = ""
    corpus_dir: str = "data/corpus"
    seed: int = 0
    batch_size: int = 2  # x 512 tokens; throughput per token measured the same at 1 and 4, memory ~1.7 GB a row
    lr: float = 3e-4
    sentinel_lr_scale: float = 10.0  # the rows start as Gemma's unused tokens and must move far, fast
    warmup_steps: int = 100
    max_steps: int = 8000  # 2 x 512 tokens a step: ~8M tokens, days on a 2-core CPU (BENCHMARKS.md, "FIM fine-tune")
    decay_frac: float = 0.2
    min_lr_frac: float = 0.1
    grad_clip: float = 1.0
    lora_rank: int = 8
    lora_alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    bf16: bool | None = None  # None: where the device has native bf16 matmuls (CUDA; AMX/avx512_bf16 CPUs)
    log_every: int = 10
    eval_every: int = 200  # ~200k tokens between points of the curve
    eval_batches: int = 4
    checkpoint_minutes: float = 10.0
    # Plain targets: (1 - w) CE + w KL(base || adapted); the gradient is CE against the mixture w base + (1 - w) data,
    # so w bounds how far plain text can pull the model toward the corpus. The 64k run (w = 0) after 246k tokens had
    # not drifted outside the corpus (probe NLL/char -0.8% news, -0.7% dialogue: the hard CE partly repairs the
    # conversion's loss against Gemma 3, which a pure anchor, w = 1, would forbid) while its corpus loss fell 7%.
    # With the original Gemma 3 as the teacher (`plain_teacher`) the soft target is itself the repair, so most of
    # the plain signal (0.8) goes to it and a fifth stays real text.
    # A saved config without the key loads as 0.0 (the objective it was trained with).
    plain_anchor: float = DEFAULT_PLAIN_ANCHOR
    # Whose distribution the anchor holds plain text to: "base" (the converted base, adapters off) or "gemma3" (the
    # original Gemma 3 restricted to the trimmed vocabulary, `canvas.training.fim_teacher`): the converted base is
    # 1.02-1.07x Gemma 3's NLL/char on text outside the corpus (BENCHMARKS.md, issue 28), and distilling from the
    # original teaches that loss back instead of holding it. A saved config without the key loads as "base".
    plain_teacher: str = "gemma3"
    data: FimDataConfig = field(default_factory=FimDataConfig)

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_steps", "log_every", "eval_every", "eval_batches", "lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.grad_clip <= 0 or self.checkpoint_minutes <= 0 or self.warmup_steps < 0:
            raise ValueError("need lr > 0, grad_clip > 0, checkpoint_minutes > 0, warmup_steps >= 0")
        if not self.targets:
            raise ValueError("targets must name at least one matrix")
        if not 0.0 <= self.plain_anchor <= 1.0:
            raise ValueError(f"plain_anchor must be in [0, 1], got {self.plain_anchor}")
        if self.plain_teacher not in ("base", "gemma3"):
            raise ValueError(f"plain_teacher must be 'base' or 'gemma3', got {self.plain_teacher!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> FimTrainConfig:
        raw = {"plain_anchor": 0.0, "plain_teacher": "base", **raw}  # an older run resumes with its objective
        data = FimDataConfig(**{"gaps": "spans", "code_share": None, **raw.pop("data", {})})  # and with its gaps
        return cls(**{**raw, "targets": tuple(raw.get("targets", DEFAULT_TARGETS))}, data=data)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        decay_start = int(self.max_steps * (1 - self.decay_frac))
        frac = min(1.0, max(0, step - decay_start) / max(1, self.max_steps - decay_start))
        return self.lr * (1 - frac * (1 - self.min_lr_frac))


_adapters_on = True


@contextmanager
def adapters_off() -> Iterator[None]:
    """Every `LowRankWeight` computes its frozen matrix only (the base model) inside this block."""
    global _adapters_on
    before, _adapters_on = _adapters_on, False
    try:
        yield
    finally:
        _adapters_on = before


class LowRankWeight(low_rank.LowRankWeight):
    """A frozen matrix W that carries its FIM adapter (`canvas.engine.decoder_weights.LowRankWeight`: `F.linear(x, w)`
    computes x W^T + (x A^T) B^T * scale, and the backward forms only the adapter's small gradients), in every pass
    but inside `adapters_off` (the base, the anchor's teacher). The merge (`apply_fim_adapters`) adds B A * scale to
    W: the same function, up to fp32 rounding."""

    @classmethod
    def active(cls) -> bool:
        return _adapters_on


class SentinelRows(nn.Module):
    """The FIM sentinels' embedding rows, trained in place of the frozen embedding's (input and tied head)."""

    ids: Tensor
    slot: Tensor

    def __init__(self, model: DiffusionModel, ids: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("ids", torch.tensor(ids, dtype=torch.long, device=model.device))
        slot = torch.full((model.config.vocab_size,), -1, dtype=torch.long, device=model.device)
        slot[self.ids] = torch.arange(len(ids), device=model.device)
        self.register_buffer("slot", slot)
        self.rows = nn.Parameter(model.embed.detach()[self.ids].clone())  # exactly the base at first

    def embed(self, model: DiffusionModel, ids: Tensor) -> Tensor:
        """`model.embed_tokens` with the sentinel rows swapped in. (B, T) -> (B, T, M)."""
        x = F.embedding(ids, model.embed)
        hit = self.slot[ids] >= 0
        x = x.index_put((hit,), self.rows[self.slot[ids[hit]]].to(x.dtype))
        return x * torch.tensor(model.config.embed_scale, dtype=x.dtype)

    def head_logits(self, model: DiffusionModel, h: Tensor, *, sentinels: bool = True) -> Tensor:
        """The tied head's fp32 logits, the sentinel columns from the rows (or, `sentinels=False`, the base's own
        embedding: the frozen model). h (N, M) -> (N, V)."""
        cfg = model.config
        x = h.float()
        x = (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps, -0.5) * model.norm.float()).type_as(h)
        logits = F.linear(x, model.embed).float()  # (N, V): no gradient into the frozen embedding
        if sentinels:
            logits = logits.index_copy(1, self.ids, F.linear(x, self.rows.to(x.dtype)).float())
        cap = cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def head_ce(self, model: DiffusionModel, h: Tensor, targets: Tensor) -> Tensor:
        """Per-token CE of the tied head with the sentinel columns from the rows. h (N, M), targets (N,) -> (N,)."""
        return F.cross_entropy(self.head_logits(model, h), targets, reduction="none")


def attach_fim_adapters(model: DiffusionModel, rank: int, alpha: float, targets: tuple[str, ...],
                        sentinel_ids: tuple[int, ...], seed: int = 0) -> SentinelRows:
    """Freeze the model, put LoRA on `targets` of every layer but the appended last one; returns the sentinel rows
    (a module of its own, on the model's device)."""
    last = model.config.num_hidden_layers - 1
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, p in list(model.named_parameters()):
        parts = name.split(".")
        if parts[0] == "layers" and int(parts[1]) < last and ".".join(parts[2:]) in targets:
            module, leaf = param_owner(model, name)
            lora = LoRA(p.shape[0], p.shape[1], rank, alpha, gen).to(p.device)  # drawn on the CPU: any device
            module.add_module(leaf + _LORA, lora)
            setattr(module, leaf, LowRankWeight(p.detach(), lora))
    return SentinelRows(model, sentinel_ids)


def fim_tensors(model: DiffusionModel, rows: SentinelRows) -> dict[str, Tensor]:
    """The trained tensors by the adapter file's names (`<param>.lora_A/B`, `SENTINEL_ROWS`)."""
    out: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRA) and name.endswith(_LORA):
            out[name.removesuffix(_LORA) + ".lora_A"] = module.lora_A.detach()
            out[name.removesuffix(_LORA) + ".lora_B"] = module.lora_B.detach()
    out[SENTINEL_ROWS] = rows.rows.detach()
    return out


def load_fim_tensors(model: DiffusionModel, rows: SentinelRows, tensors: dict[str, Tensor]) -> None:
    own = fim_tensors(model, rows)
    if set(own) != set(tensors):
        raise ValueError(f"checkpoint tensors differ from the model's adapters (rank or targets changed?): "
                         f"missing {sorted(set(own) - set(tensors))[:3]}, extra {sorted(set(tensors) - set(own))[:3]}")
    with torch.no_grad():
        for name, t in tensors.items():
            own[name].copy_(t)


def _packed_hidden(model: DiffusionModel, batch: Rows, x: Tensor) -> Tensor:
    """The layer stack over embedded packed rows x (B, T, M), attention inside each piece only -> (B, T, M)."""
    cfg = model.config
    masks = {s: attention_mask(batch, cfg.sliding_window if s else None) for s in (False, True)}

    def within_pieces(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        return k, v, masks[model.blocks[i].attn.sliding]

    return model.run_layers(x, batch.positions, within_pieces, decoder=False)


def teaching_states(model: DiffusionModel, rows: SentinelRows, batch: Rows) -> tuple[Tensor, Tensor, Tensor]:
    """The adapted model's hidden states at the positions that predict a target (N, M), the targets (N,), kinds (N,)."""
    x = _packed_hidden(model, batch, rows.embed(model, batch.ids))  # (B, T, M)
    teach = batch.kind[:, 1:] != NONE  # target t+1 is predicted at t (never across a piece: a piece starts with bos)
    return x[:, :-1][teach], batch.ids[:, 1:][teach], batch.kind[:, 1:][teach]


def packed_losses(model: DiffusionModel, rows: SentinelRows, batch: Rows) -> tuple[Tensor, Tensor]:
    """Per-target CE and each target's kind, over the positions that teach. The layer stack runs on the packed rows
    (attention inside each piece only), the head only on the hidden states that predict a target."""
    h, targets, kind = teaching_states(model, rows, batch)
    return rows.head_ce(model, h, targets), kind


def plain_pieces(batch: Rows) -> Rows:
    """The batch with its FIM pieces dropped: each row's plain pieces moved to the front, in order and whole (so
    positions, the causal order and the sliding window inside a piece are as they were), padded to the longest row.
    The PLAIN targets come out in the same order as in `batch`."""
    B, T = batch.ids.shape
    seg = batch.segment.clamp(min=0)
    has_plain = torch.zeros(B, T, dtype=torch.long, device=seg.device)
    has_plain.scatter_add_(1, seg, (batch.kind == PLAIN).long())
    keep = (batch.segment >= 0) & (has_plain.gather(1, seg) > 0)  # (B, T)
    width = max(2, int(keep.sum(1).max()))
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]  # kept first, in order
    kept = keep.gather(1, order)
    pick = [t.gather(1, order) for t in (batch.ids, batch.positions, batch.segment, batch.kind)]
    return Rows(pick[0], pick[1], torch.where(kept, pick[2], -1), torch.where(kept, pick[3], NONE))


@torch.no_grad()
def base_plain_logprobs(model: DiffusionModel, rows: SentinelRows, batch: Rows) -> Tensor:
    """The frozen base's next-token log-probabilities at the PLAIN targets of `batch`, in their order (P, V): the
    adapters off, the embedding's own sentinel rows, only the plain pieces run (FIM pieces cannot reach them)."""
    plain = plain_pieces(batch)
    with adapters_off():
        x = _packed_hidden(model, plain, model.embed_tokens(plain.ids))  # (B, T', M)
    h = x[:, :-1][plain.kind[:, 1:] == PLAIN]  # (P, M)
    return F.log_softmax(rows.head_logits(model, h, sentinels=False), dim=-1)


@dataclass(frozen=True, slots=True)
class PackedLoss:
    """Per target, over the positions that teach: the loss trained on, the hard CE, and each target's kind; `kl`
    (KL(base || adapted) at the PLAIN targets, in order) where the anchor ran."""

    loss: Tensor  # (N,)
    ce: Tensor  # (N,)
    kind: Tensor  # (N,)
    kl: Tensor | None  # (P,)


def anchored_losses(model: DiffusionModel, rows: SentinelRows, batch: Rows, anchor: float,
                    teacher: Callable[[Rows], Tensor] | None = None) -> PackedLoss:
    """`packed_losses` with the plain targets' loss (1 - anchor) CE + anchor KL(teacher || adapted); FIM targets
    keep the CE. The teacher maps the batch to log-probabilities at its PLAIN targets, in order (P, V); None is the
    frozen base (`base_plain_logprobs`). anchor = 0 runs no teacher pass (the old objective, bit for bit)."""
    h, targets, kind = teaching_states(model, rows, batch)
    logits = rows.head_logits(model, h)  # (N, V)
    ce = F.cross_entropy(logits, targets, reduction="none")
    if anchor <= 0:
        return PackedLoss(ce, ce, kind, None)
    plain = kind == PLAIN
    base = teacher(batch) if teacher is not None else base_plain_logprobs(model, rows, batch)  # (P, V)
    kl = F.kl_div(F.log_softmax(logits[plain], dim=-1), base, log_target=True, reduction="none").sum(-1)  # (P,)
    loss = ce.masked_scatter(plain, (1 - anchor) * ce[plain] + anchor * kl)
    return PackedLoss(loss, ce, kind, kl)


@dataclass(slots=True)
class FimState:
    step: int = 0
    tokens_seen: int = 0  # packed tokens read (padding excluded)
    loss_tokens: int = 0  # of which targets
    wall_seconds: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)


def fim_tokens_dir(base: str | Path, root: Path = Path("data")) -> Path:
    """The default token cache of a base: named by its vocabulary (`data/tokens-fim-96k`), so bases of different
    vocabularies never share one (the tokenizer hash check still refuses a same-size tokenizer that differs)."""
    from tokenizers import Tokenizer

    n = Tokenizer.from_file(str(Path(base) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    return root / (f"tokens-fim-{n // 1024}k" if n % 1024 == 0 else f"tokens-fim-{n}")


def _ensure_tokens(cfg: FimTrainConfig) -> Path:
    """The corpus tokenized with the base's tokenizer; made on first use, refused when made with another."""
    from canvas.training.tokens import file_sha256, tokenize_corpus

    out, tok = Path(cfg.tokens_dir or fim_tokens_dir(cfg.base)), Path(cfg.base) / "tokenizer.json"
    meta = out / "meta.json"
    if not meta.exists():
        tokenize_corpus(Path(cfg.corpus_dir), Path(cfg.base), out)
    made = json.loads(meta.read_text())
    if made["tokenizer_sha256"] != file_sha256(tok):
        raise ValueError(f"{out} was tokenized with another tokenizer than {tok}; use another --tokens-dir")
    train = Path(cfg.corpus_dir) / "train.jsonl"  # where the corpus is here: the tokens must be made from it
    if train.exists() and made["splits"]["train"]["corpus_sha256"] != file_sha256(train):
        raise ValueError(f"{out} was tokenized from another {train}; delete it to tokenize again, or --tokens-dir")
    return out


def _corpus(tokens_dir: Path, split: str, tokenizer: Any, starts: Any, ends: Any) -> Corpus:
    from canvas.convert.fim import fim_tokens
    from canvas.training.tokens import TokenArrays

    arr = TokenArrays.open(tokens_dir, split)
    return Corpus(arr.tokens, arr.doc_starts, starts, ends, fim_tokens(tokenizer), arr.kinds, tokenizer)


def uses_bf16(cfg: FimTrainConfig, device: torch.device) -> bool:
    if cfg.bf16 is not None:
        return cfg.bf16
    if device.type == "cuda":
        return True
    from canvas.model.cpu import cpu_kind

    return cpu_kind() in ("amx", "avx512_bf16", "arm_bf16")


def require_plain_base(base: Path) -> None:
    """Refuse a base build that already merged FIM adapters (its `build.json` records them): the run's adapters
    would train on top of a copy of themselves, and its plain anchor would hold the wrong model."""
    if recorded_fim_adapters(base) is not None:
        raise ValueError(f"{base}: this build already has the FIM adapters merged; fine-tune the build without them "
                         "(`dcanvas model build --without-fim` prints its directory)")


class FimTrainer:
    def __init__(self, run_dir: Path, cfg: FimTrainConfig, *, device: str = "cpu") -> None:
        from tokenizers import Tokenizer

        from canvas.convert.fim import word_boundaries

        require_plain_base(Path(cfg.base))
        self.run_dir, self.cfg, self.device = run_dir, cfg, torch.device(device)
        tokens = _ensure_tokens(cfg)
        tok = Tokenizer.from_file(str(Path(cfg.base) / "tokenizer.json"))
        starts, ends = word_boundaries(tok)
        self.train_data = _corpus(tokens, "train", tok, starts, ends)
        self.valid_data = _corpus(tokens, "valid", tok, starts, ends)
        self.bf16 = uses_bf16(cfg, self.device)
        self.model = DiffusionModel.from_pretrained(cfg.base, device=self.device)
        self.rows = attach_fim_adapters(self.model, cfg.lora_rank, cfg.lora_alpha, cfg.targets,
                                        self.train_data.ids.sentinels, seed=cfg.seed)
        lora = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            [{"params": lora, "lr_scale": 1.0}, {"params": [self.rows.rows], "lr_scale": cfg.sentinel_lr_scale}],
            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
        )  # fmt: skip
        self.state = FimState()
        self.teacher: Callable[[Rows], Tensor] | None = None  # None: the frozen base (adapters off)
        if cfg.plain_anchor > 0 and cfg.plain_teacher == "gemma3":
            from canvas.training.fim_teacher import GemmaTeacher

            self.teacher = GemmaTeacher.load(Path(cfg.base), device=self.device).plain_log_probs

    # ---- checkpoints ------------------------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoint.pt"

    def save(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "adapters": {k: v.cpu() for k, v in fim_tensors(self.model, self.rows).items()},
            "optimizer": self.optimizer.state_dict(),
            "state": asdict(self.state),
            "train_config": self.cfg.to_json(),
            "model_config": self.model.config.to_hf_dict(),
        }
        save_checkpoint(payload, self.checkpoint_path)
        self.write_curve()

    def load(self) -> bool:
        if not self.checkpoint_path.exists():
            return False
        payload = torch.load(self.checkpoint_path, map_location=self.device, weights_only=False)
        if payload["model_config"] != self.model.config.to_hf_dict():
            raise ValueError(f"{self.checkpoint_path} was trained on another base; use another --run")
        load_fim_tensors(self.model, self.rows, payload["adapters"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.state = FimState(**payload["state"])
        return True

    def write_curve(self) -> None:
        write_curve(self.run_dir, self.state.history)

    # ---- steps ------------------------------------------------------------------------------------------------
    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def train_step(self) -> dict[str, float]:
        step = self.state.step
        batch = sample_rows(self.train_data, self.cfg.data, self.cfg.batch_size, self.cfg.seed, step).to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr_at(step) * group["lr_scale"]
        self.model.train()
        with self.autocast():
            out = anchored_losses(self.model, self.rows, batch, self.cfg.plain_anchor, self.teacher)
        ce, kind = out.ce, out.kind
        loss = out.loss.mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))
        self.optimizer.step()
        self.state.step += 1
        self.state.tokens_seen += batch.tokens
        self.state.loss_tokens += int(ce.numel())
        fim, plain = ce[kind == FIM].detach(), ce[kind == PLAIN].detach()
        kl = out.kl.detach() if out.kl is not None else torch.empty(0)
        return {"loss": float(loss.detach()), "fim": float(fim.mean()) if fim.numel() else math.nan,
                "plain": float(plain.mean()) if plain.numel() else math.nan, "grad_norm": grad_norm,
                "lr": self.cfg.lr_at(step), **({"plain_kl": float(kl.mean())} if kl.numel() else {})}  # fmt: skip

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out FIM loss, plain loss and the plain rows' KL from the teacher, on the same validation rows every time
        (token-weighted means). Where the corpus has code, these are prose's, and `valid_code_fim` / `valid_code`
        (and `valid_code_kl`) the code's."""
        self.model.eval()
        out: dict[str, float] = {}
        evals = [("valid_fim", VALID_FIM_STREAM, 1.0, 0.0), ("valid_plain", VALID_PLAIN_STREAM, 0.0, 0.0)]
        if self.valid_data.has_code:
            evals += [("valid_code_fim", VALID_CODE_FIM_STREAM, 1.0, 1.0), ("valid_code", VALID_CODE_STREAM, 0.0, 1.0)]
        for key, stream, rate, code in evals:
            data = FimDataConfig(**{**asdict(self.cfg.data), "fim_rate": rate, "code_share": code})
            total, count, kl_total = 0.0, 0, 0.0
            for i in range(self.cfg.eval_batches):
                batch = sample_rows(self.valid_data, data, self.cfg.batch_size, self.cfg.seed, i, stream)
                with self.autocast():
                    losses = anchored_losses(self.model, self.rows, batch.to(self.device), 1.0 if rate == 0 else 0.0,
                                             self.teacher)
                total, count = total + float(losses.ce.sum()), count + int(losses.ce.numel())
                kl_total += float(losses.kl.sum()) if losses.kl is not None else 0.0
            out[key] = total / max(1, count)
            if rate == 0:
                out[f"{key}_kl" if code else "valid_plain_kl"] = kl_total / max(1, count)
        first = next((r["valid_plain"] for r in self.state.history if "valid_plain" in r), out["valid_plain"])
        out["plain_ppl_ratio"] = math.exp(out["valid_plain"] - first)
        return out

    def fit(self, *, max_minutes: float | None, stop_at_step: int | None, console: Any) -> FimState:
        """Train until `max_steps`, `stop_at_step` or `max_minutes` of this invocation; checkpoint on the way. A new
        run logs the base's held-out losses at step 0 first (the fidelity reference)."""
        if not self.state.history:
            self.state.history.append({"step": 0, "tokens": 0, "wall_s": 0.0, **self.evaluate()})
            console.print(f"step 0 (base): {self.state.history[-1]}")
        end = min(self.cfg.max_steps, stop_at_step or self.cfg.max_steps)
        started = last_ckpt = time.perf_counter()
        window: list[dict[str, float]] = []
        window_tokens, window_time = 0, 0.0
        while self.state.step < end:
            if max_minutes is not None and time.perf_counter() - started > 60 * max_minutes:
                console.print(f"stopping after {max_minutes} min (step {self.state.step})")
                break
            t0, before = time.perf_counter(), self.state.tokens_seen
            window.append(self.train_step())
            dt = time.perf_counter() - t0
            self.state.wall_seconds += dt
            window_tokens, window_time = window_tokens + self.state.tokens_seen - before, window_time + dt
            step = self.state.step
            if step % self.cfg.log_every == 0 or step == end:
                keys = dict.fromkeys(k for r in window for k in r)  # plain_kl: only steps with plain targets
                row = {k: _nanmean([r.get(k, math.nan) for r in window]) for k in keys}
                row.update(step=step, tokens=self.state.tokens_seen, loss_tokens=self.state.loss_tokens,
                           wall_s=round(self.state.wall_seconds, 1))
                row["tokens_per_s"] = window_tokens / max(window_time, 1e-9)
                if step % self.cfg.eval_every == 0 or step == end:
                    row.update(self.evaluate())
                self.state.history.append(row)
                info = f"loss {row['loss']:.3f} (fim {row['fim']:.3f}, plain {row['plain']:.3f}) " \
                       f"{row['tokens_per_s']:.0f} tok/s lr {row['lr']:.2e}"
                if "plain_kl" in row:
                    info += f" kl {row['plain_kl']:.4f}"
                if "valid_fim" in row:
                    info += f" | valid fim {row['valid_fim']:.3f} plain {row['valid_plain']:.3f} " \
                            f"(ppl x{row['plain_ppl_ratio']:.4f}, kl {row['valid_plain_kl']:.4f})"
                console.print(f"step {step}: {info}")
                window, window_tokens, window_time = [], 0, 0.0
            if time.perf_counter() - last_ckpt > 60 * self.cfg.checkpoint_minutes:
                self.save()
                last_ckpt = time.perf_counter()
        self.save()
        return self.state


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def export_fim_adapters(trainer: FimTrainer, out: Path) -> Path:
    """Write the FIM adapter set (fp32: merged, it reproduces the trained model's weights exactly) that
    `dcanvas model build` applies."""
    from safetensors.torch import save_file

    from canvas.convert.source import sha256_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in fim_tensors(trainer.model, trainer.rows).items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    cfg = trainer.model.config.to_hf_dict()
    cfg.pop("name", None)
    st = trainer.state
    meta = {"objective": "fim", "rank": trainer.cfg.lora_rank, "scale": trainer.cfg.lora_alpha / trainer.cfg.lora_rank,
            "targets": list(trainer.cfg.targets), "sentinels": list(SENTINELS), "base_config": cfg,
            "step": st.step, "tokens_seen": st.tokens_seen, "sha256": sha256_file(out / WEIGHTS)}  # fmt: skip
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    return out
