"""The tiny seeded models lib's tests build, in one place: a test names the model it needs and
the few settings that matter to it, not how to make one. Each builder seeds torch's global
generator first, so the same call gives the same weights in every test file."""

import torch

from lib.gpt import GPT, GPTConfig
from lib.hybrid import HybridGPT
from lib.llama import Llama, LlamaConfig
from lib.mamba import MambaConfig
from lib.mamba_lm import MambaLM


def gpt(seed: int = 0, **changes) -> GPT:
    """A GPT-2-style decoder from `GPTConfig.tiny` (4 layers, width 128 unless changed), in eval mode."""
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny(**changes)).eval()


def llama(seed: int = 0, **changes) -> Llama:
    """A Llama-family decoder from `LlamaConfig.tiny` (grouped-query heads), in eval mode."""
    torch.manual_seed(seed)
    return Llama(LlamaConfig.tiny(**changes)).eval()


def mamba(seed: int = 0, **changes) -> MambaLM:
    """A Mamba LM from `MambaConfig.tiny` (width 32 and 2 layers unless changed), in eval mode."""
    torch.manual_seed(seed)
    return MambaLM(MambaConfig.tiny(**{"d_model": 32, "n_layers": 2, **changes})).eval()


def hybrid(pattern: str = "MAM", positions: str = "rope", seed: int = 0) -> HybridGPT:
    """A GPT whose layers follow `pattern` (A attention, M a Mamba mixer), width 32, vocabulary 20."""
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=20, block_size=48, n_layer=len(pattern), n_head=4, n_embd=32, positions=positions)
    return HybridGPT(config, pattern, MambaConfig(vocab_size=20, d_model=32, n_layers=1, d_state=8)).eval()
