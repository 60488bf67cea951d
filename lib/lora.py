"""Low-rank adaptation (LoRA): fine-tune a frozen linear layer through a rank-r update.

Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685,
section 4.1: a pretrained weight W (out, in) stays frozen and the layer computes
    h = W x + (alpha / r) · B A x,    A (r, in), B (out, r),
with A random and B zero at the start, so training begins exactly at the pretrained model, and
only r·(in + out) numbers per layer are trained instead of in·out. After training, B A can be
added into W (`merged`), so inference costs nothing extra.

    LoRALinear         wraps one nn.Linear: frozen base + trainable lora_A, lora_B
    add_lora           freeze a model and wrap its Linear layers whose names are in `targets`
    merge_lora         fold every LoRALinear back into a plain nn.Linear, in place
    count_parameters   how many numbers a model holds, or trains

Glossary: B batch, T positions, in/out the layer's in_features/out_features, r the rank.
(`lora_B` is the paper's B matrix, not the batch size.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn

from lib._checks import require_int, require_real, require_tensor

__all__ = ["LoRALinear", "add_lora", "count_parameters", "merge_lora"]


def _check_alpha(alpha) -> float:
    return require_real("alpha", alpha, above=0, note=" (the update is scaled by alpha / r)")


def _check_model(model) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / r) · x Aᵀ Bᵀ, with `base` frozen and only A (r, in), B (out, r) trained."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"base must be a torch.nn.Linear, got {type(base).__name__}")
        require_int("r", r, minimum=1)
        self.r, self.alpha = r, _check_alpha(alpha)
        self.scaling = self.alpha / r  # the paper's alpha/r keeps the update's size steady as r changes
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, **like))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, **like))  # (out, r)
        # nn.Linear's own init, as PEFT and the paper's loralib use. B = 0 makes the update zero at
        # the start; A must not also be zero, or neither factor would ever get a gradient.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        require_tensor("x", x, floating=True)
        W = self.base.weight
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have shape (..., in_features) = (..., {self.in_features}), got {tuple(x.shape)}")
        # under autocast the base layer casts x itself, so a dtype mismatch is expected there
        if x.device != W.device or (x.dtype != W.dtype and not torch.is_autocast_enabled(x.device.type)):
            raise ValueError(
                f"x must match the layer's dtype {W.dtype} and device {W.device}, got {x.dtype} on {x.device}"
            )
        # A first: (..., in) -> (..., r) -> (..., out) never builds the (out, in) product B A
        update = (x @ self.lora_A.T) @ self.lora_B.T  # (..., in) @ (in, r) @ (r, out) -> (..., out)
        return self.base(x) + update * self.scaling

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A new plain nn.Linear with weight W + (alpha/r)·B A and the base's bias, sharing no storage.

        Its parameters are frozen like the base they replace (requires_grad_() to train them).
        """
        W, bias = self.base.weight, self.base.bias
        # skip_init: no random init to overwrite, and the global RNG stream is left untouched
        out = torch.nn.utils.skip_init(
            nn.Linear, self.in_features, self.out_features, bias=bias is not None, dtype=W.dtype, device=W.device
        )
        # summed in float32 at least, so a float16 weight is rounded once, not after each step
        work = torch.promote_types(W.dtype, torch.float32)
        delta = self.lora_B.to(work) @ self.lora_A.to(work)  # (out, r) @ (r, in) -> (out, in)
        out.weight.copy_(W.to(work) + self.scaling * delta)
        if bias is not None:
            out.bias.copy_(bias)
        out.requires_grad_(False)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, alpha={self.alpha:g}"


def _parent_and_leaf(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, leaf = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), leaf


def _truncated(names: list[str], limit: int = 12) -> str:
    if not names:
        return "none"
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def add_lora(model: nn.Module, targets: Iterable[str], r: int = 8, alpha: float = 16.0) -> list[str]:
    """Freeze every parameter of `model`, then wrap in a LoRALinear each nn.Linear whose name's last
    component is in `targets` (e.g. ("c_attn", "c_proj")). Returns the wrapped names, sorted.

    Everything is checked before the model is touched, so a failed call leaves it unchanged.
    """
    _check_model(model)
    if isinstance(targets, str) or not isinstance(targets, Iterable):
        raise TypeError(f"targets must be an iterable of module names such as ('c_attn', 'c_proj'), got {targets!r}")
    targets = list(targets)
    if not all(isinstance(t, str) for t in targets):
        raise TypeError(f"targets must hold only str module names, got {targets!r}")
    if not targets:
        raise ValueError("targets must name at least one module, e.g. ('c_attn', 'c_proj'), got none")
    targets = set(targets)
    require_int("r", r, minimum=1)
    _check_alpha(alpha)

    existing = sorted(name or "<model itself>" for name, m in model.named_modules() if isinstance(m, LoRALinear))
    if existing:
        raise ValueError(
            f"model already holds LoRA layers ({_truncated(existing)}): add_lora applies once, to a model "
            "without adapters; name every target in one call, or merge_lora(model) first"
        )
    linear, chosen, not_linear = [], [], []
    for name, module in model.named_modules():
        is_target = bool(name) and name.rpartition(".")[2] in targets
        if isinstance(module, nn.Linear):
            linear.append(name or "<model itself>")
            if is_target:
                chosen.append(name)
        elif is_target:
            not_linear.append(f"{name} ({type(module).__name__})")
    if not chosen:
        # Hugging Face GPT-2 names its projections c_attn/c_proj too, but they are Conv1D layers
        hint = (
            f"; modules with those names exist but are not nn.Linear: {_truncated(not_linear, 6)}" if not_linear else ""
        )
        raise ValueError(
            f"targets {sorted(targets)} matched no nn.Linear in the model; its nn.Linear modules are: "
            f"{_truncated(linear)}{hint}"
        )
    for name in chosen:
        if isinstance(_parent_and_leaf(model, name)[0], nn.MultiheadAttention):
            # it reads out_proj.weight directly instead of calling out_proj, so a wrapper would be bypassed
            raise ValueError(
                f"targets matched {name}, the output projection inside nn.MultiheadAttention, which "
                "LoRALinear cannot wrap"
            )
    chosen.sort()

    model.requires_grad_(False)
    for name in chosen:
        parent, leaf = _parent_and_leaf(model, name)
        setattr(parent, leaf, LoRALinear(getattr(parent, leaf), r=r, alpha=alpha))
    return chosen


def merge_lora(model: nn.Module) -> list[str]:
    """Replace every LoRALinear inside `model` by its `merged()` nn.Linear, in place.

    Returns the merged names, sorted ([] when there is nothing to merge).
    """
    _check_model(model)
    if isinstance(model, LoRALinear):
        raise ValueError("model is itself a LoRALinear and cannot be replaced in place; use model.merged()")
    names = sorted(name for name, m in model.named_modules() if isinstance(m, LoRALinear))
    for name in names:
        parent, leaf = _parent_and_leaf(model, name)
        setattr(parent, leaf, getattr(parent, leaf).merged())
    return names


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of scalars in the model's parameters (each shared tensor counted once); with
    `trainable_only`, only those with requires_grad."""
    _check_model(model)
    if not isinstance(trainable_only, bool):
        raise TypeError(f"trainable_only must be a bool, got {type(trainable_only).__name__}")
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
